"""The ``deepspeed`` import alias (shardwise.integrations) in this process: what the import
system, importlib.metadata and the version checks of transformers/accelerate see, module
identity, refusals, undo; the HF engine adapter's accumulation boundary and 16-bit state.

The Trainer and Accelerate runs themselves are in tests/distributed/test_hf_integration.py
(fresh processes: transformers must be imported after the alias)."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types

import pytest
import torch

import shardwise
import shardwise.integrations as integrations
from shardwise.config import load_config
from shardwise.integrations import alias
from tests.distributed._parity import engine_config, global_batches, make_model


@pytest.fixture
def ds(monkeypatch: pytest.MonkeyPatch):
    """The alias on for one test; transformers' cached verdict hidden, everything undone."""
    monkeypatch.delitem(sys.modules, "transformers.integrations.deepspeed", raising=False)
    assert "deepspeed" not in sys.modules
    integrations.use_as_deepspeed()
    try:
        yield importlib.import_module("deepspeed")
    finally:
        integrations.stop_using_as_deepspeed()


def test_detection_as_transformers_and_accelerate_do_it(ds) -> None:
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None
    meta = importlib.metadata.metadata("deepspeed")
    assert meta["Name"] == "deepspeed"
    version = importlib.metadata.version("deepspeed")
    assert version == ds.__version__ == alias.ALIAS_VERSION
    assert version.startswith(alias.DEEPSPEED_API_VERSION + "+shardwise")
    from packaging.version import Version
    assert Version(version) >= Version("0.9.3")  # transformers' minimum for deepspeed
    assert integrations.is_installed()


def test_names_are_shardwise_objects_not_copies(ds) -> None:
    import deepspeed.comm
    import deepspeed.zero
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.runtime.zero import partition_parameters as pp
    assert deepspeed.zero is shardwise.zero and deepspeed.comm is shardwise.comm
    assert ds.zero.GatheredParameters is shardwise.zero.GatheredParameters
    assert DeepSpeedEngine is shardwise.ShardwiseEngine
    assert ds.runtime.lr_schedules.VALID_LR_SCHEDULES is VALID_LR_SCHEDULES
    assert "WarmupDecayLR" in VALID_LR_SCHEDULES
    assert pp.zero_wrapper_for_fp_tensor_constructor(torch.arange) is torch.arange
    # the aliased module keeps its own identity (spec, name)
    assert shardwise.zero.__spec__.name == "shardwise.zero"
    assert shardwise.zero.__name__ == "shardwise.zero"
    assert ds.accelerator.get_accelerator().current_device_name() in ("cpu", "cuda:0", "xpu:0",
                                                                         "mps")


def test_helpers_transformers_and_accelerate_import(ds) -> None:
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.utils import logger, set_z3_leaf_modules
    assert logger is shardwise.utils.logging.logger
    base = torch.arange(6.0)
    state = {"a": base[:2], "n": [base[2:4]], "k": 3}
    cloned = clone_tensors_for_torch_save(state)
    assert cloned["a"].untyped_storage().nbytes() == 8 and cloned["k"] == 3
    assert torch.equal(cloned["n"][0], base[2:4])
    model = torch.nn.Linear(2, 2)
    opt = DeepSpeedCPUAdam(model.parameters(), lr=0.1, adamw_mode=True)
    assert isinstance(opt, torch.optim.AdamW)
    with pytest.raises(shardwise.ShardwiseError, match="set_z3_leaf_modules"):
        set_z3_leaf_modules(model, [torch.nn.Linear])
    with pytest.raises(AttributeError, match="docs/integrations.md"):
        ds.pipe  # noqa: B018 - a DeepSpeed name shardwise does not serve
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("deepspeed.inference.engine")


def test_undo_removes_every_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "transformers.integrations.deepspeed", raising=False)
    integrations.use_as_deepspeed()
    integrations.use_as_deepspeed()  # idempotent
    import deepspeed.runtime.engine  # noqa: F401
    integrations.stop_using_as_deepspeed()
    assert not integrations.is_installed()
    assert not [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]
    assert not any(isinstance(f, alias.DeepSpeedAliasFinder) for f in sys.meta_path)
    if importlib.util.find_spec("deepspeed") is None:  # no real DeepSpeed on this machine
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("deepspeed")


def test_refuses_when_transformers_already_decided_no_deepspeed(monkeypatch) -> None:
    stale = types.ModuleType("transformers.integrations.deepspeed")
    stale.DeepSpeedConfig = object  # what transformers binds when DeepSpeed was absent
    monkeypatch.setitem(sys.modules, "transformers.integrations.deepspeed", stale)
    with pytest.raises(integrations.AliasError, match="before importing transformers"):
        integrations.use_as_deepspeed()
    assert not integrations.is_installed()


def test_refuses_when_real_deepspeed_is_imported(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "transformers.integrations.deepspeed", raising=False)
    real = types.ModuleType("deepspeed")
    real.__file__ = "/site-packages/deepspeed/__init__.py"
    monkeypatch.setitem(sys.modules, "deepspeed", real)
    with pytest.raises(integrations.AliasError, match="real `deepspeed` package"):
        integrations.use_as_deepspeed()
    assert not integrations.is_installed()


def test_config_takes_what_accelerate_writes() -> None:
    """Accelerate sets steps_per_print to float("inf") and the Trainer reads
    engine.config.get("zero_optimization", {}) as DeepSpeed's config dict."""
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": float("inf"),
                       "zero_optimization": {"stage": 3, "offload_param": {"device": "none",
                                                                           "nvme_path": None}}})
    assert cfg.steps_per_print == 0  # never
    assert cfg.get("zero_optimization", {})["stage"] == 3
    assert cfg.get("no_such_key", "d") == "d"


def _accelerate_style(engine, batches, ga: int) -> None:
    """Accelerate's loop: the boundary is set before each backward, step() only on it."""
    for x, y in batches:
        for k in range(ga):
            sl = slice(k * 2, (k + 1) * 2)
            boundary = k == ga - 1
            engine.set_gradient_accumulation_boundary(boundary)
            engine.backward(engine(x[sl], y[sl]))
            if boundary:
                engine.step()


def test_engine_adapter_boundary_matches_counter_driven_engine() -> None:
    from shardwise.integrations.engine_adapter import HfEngine, adapt
    cfg = engine_config(stage=2, micro=2, ga=2, clip=0.5, lr=1e-2)
    batches = global_batches(3, 4)
    ref, *_ = shardwise.initialize(model=make_model(), config=cfg)
    for x, y in batches:
        for k in range(2):
            ref.backward(ref(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
            ref.step()
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    engine = adapt(engine)
    assert isinstance(engine, HfEngine) and isinstance(engine, shardwise.ShardwiseEngine)
    _accelerate_style(engine, batches, ga=2)
    assert engine.global_steps == ref.global_steps == 3
    for (name, a), (_, b) in zip(ref.module.named_parameters(), engine.module.named_parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    with pytest.raises(TypeError, match="True, False or None"):
        engine.set_gradient_accumulation_boundary("yes")


def test_engine_adapter_16bit_state_dict_stage3() -> None:
    from shardwise.integrations.engine_adapter import adapt
    cfg = engine_config(stage=3, micro=2, ga=1, clip=0.0, lr=1e-2,
                        zero_optimization={"stage3_param_persistence_threshold": 0,
                                           "stage3_gather_16bit_weights_on_model_save": True})
    model = make_model()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = adapt(shardwise.initialize(model=model, config=cfg)[0])
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    assert engine.config.get("zero_optimization")["stage"] == 3
    state = engine._zero3_consolidated_16bit_state_dict()
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, atol=0, rtol=0)


def test_engine_adapter_reports_fp16_overflow_on_the_optimizer() -> None:
    """Accelerate's step_was_skipped reads optimizer.overflow (the Trainer then does not step
    its own scheduler); an inf gradient skips the step and sets it, a finite one clears it."""
    from shardwise.integrations.engine_adapter import adapt
    cfg = engine_config(stage=2, micro=2, ga=1, clip=0.0, lr=1e-2,
                        fp16={"enabled": True, "initial_scale_power": 4})
    engine = adapt(shardwise.initialize(model=make_model(), config=cfg)[0])
    assert engine.optimizer.overflow is False
    (x, y), = global_batches(1, 2)
    engine.backward(engine(x, y) * float("inf"))
    engine.step()
    assert engine.optimizer.overflow is True and engine.skipped_steps == 1
    engine.backward(engine(x, y))
    engine.step()
    assert engine.optimizer.overflow is False and engine.was_step_applied()



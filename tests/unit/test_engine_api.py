"""DeepSpeed's engine surface on the shardwise engine: every documented name resolves (to a
working method or to UnsupportedFeatureError, never AttributeError), and the methods added
for DeepSpeed scripts do what DeepSpeed's do."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.config import load_config
from shardwise.errors import ConfigError, UnsupportedFeatureError
from shardwise.runtime.deepspeed_unsupported import UNSUPPORTED_ATTRIBUTES, UNSUPPORTED_METHODS
from shardwise.zero.stage3 import partition as P
from tests.distributed._parity import engine_config, global_batches, make_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine_api.md"
_ROW = re.compile(r"^\| `(\w+)(\(\))?` \| (yes|not supported) \|")


def _documented():
    rows = [_ROW.match(line) for line in DOC.read_text(encoding="utf-8").splitlines()]
    return [(m.group(1), bool(m.group(2)), m.group(3)) for m in rows if m]


def _engine(stage: int = 1, **extra):
    cfg = engine_config(stage=stage, micro=2, ga=2, clip=0.0, lr=1e-2, **extra)
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    return engine


def _params(engine):
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def test_every_documented_deepspeed_name_resolves_or_says_what_to_do() -> None:
    rows = _documented()
    names = {name for name, _, _ in rows}
    assert len(rows) > 200 and len(names) == len(rows)  # DeepSpeed's 202 methods + attributes
    assert set(UNSUPPORTED_METHODS) | set(UNSUPPORTED_ATTRIBUTES) <= names
    engine = _engine()
    for name, is_method, status in rows:
        if status == "not supported":
            with pytest.raises(UnsupportedFeatureError, match=rf"engine\.{name}(\(\))? is not "
                                                              r"supported in shardwise: .+ Instead: "):
                value = getattr(engine, name)
                value()  # a method: the call raises; an attribute: the access above did
            continue
        value = getattr(engine, name)  # no AttributeError, no module fall-through
        assert name not in UNSUPPORTED_METHODS and name not in UNSUPPORTED_ATTRIBUTES, name
        if is_method:
            assert callable(value), name


def test_deepspeed_names_win_over_the_modules_namesakes() -> None:
    engine = _engine()
    engine.module.tput_timer = "the model's own"        # a DeepSpeed attribute name
    engine.module.offload_states = lambda: "the model's"  # a DeepSpeed method name
    with pytest.raises(UnsupportedFeatureError, match="engine.tput_timer is not supported"):
        engine.tput_timer
    with pytest.raises(UnsupportedFeatureError, match=r"offload_states\(\) is not supported"):
        engine.offload_states()
    assert engine.fc1 is engine.module.fc1  # other names still reach the module


def test_precision_queries_follow_the_config() -> None:
    engine = _engine()
    assert (engine.fp16_enabled(), engine.bfloat16_enabled()) == (False, False)
    assert engine.communication_data_type == torch.float32
    bf16 = _engine(bf16={"enabled": True})
    assert (bf16.fp16_enabled(), bf16.bfloat16_enabled()) == (False, True)
    assert bf16.get_data_types() == (torch.bfloat16, torch.float32)
    fp16 = _engine(fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50})
    assert (fp16.fp16_enabled(), fp16.bfloat16_enabled(), fp16.dynamic_loss_scale()) == (True, False, True)
    assert fp16.initial_dynamic_scale() == 256.0
    assert fp16.dynamic_loss_scale_args()["scale_window"] == 50
    with pytest.raises(UnsupportedFeatureError, match="communication_data_type"):
        fp16.communication_data_type = torch.float16


def test_get_mom_returns_betas_or_momentum_per_group() -> None:
    assert _engine().get_mom() == [(0.9, 0.999)]
    model = make_model()
    groups = [{"params": model.fc1.parameters(), "momentum": 0.5},
              {"params": list(model.fc2.parameters()) + list(model.head.parameters())}]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    engine, *_ = shardwise.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0})
    assert engine.get_mom() == [0.5, 0.9]
    assert engine.optimizer_name() == "SGD" and engine.get_lr() == [0.1, 0.1]


def test_set_train_batch_size_changes_accumulation_and_keeps_micro_batch() -> None:
    engine = _engine()
    engine.set_train_batch_size(8)
    assert engine.get_batch_info() == (8, 2, 4)
    assert engine.gradient_accumulation_steps() == 4 and engine.train_micro_batch_size_per_gpu() == 2
    (x, y), = global_batches(1, 8)
    for k in range(4):
        engine.backward(engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
        engine.step()
        assert engine.was_step_applied() == (k == 3)
    assert engine.global_samples == 8
    with pytest.raises(ConfigError, match=r"multiple of .* = 2 x 1 = 2"):
        engine.set_train_batch_size(7)
    engine.set_train_micro_batch_size(4)
    assert engine.get_batch_info() == (16, 4, 4)


@pytest.mark.parametrize("stage", [2, 3])
def test_manual_accumulation_boundary_matches_the_counter(stage: int) -> None:
    batches = global_batches(2, 4)
    counted = _engine(stage)
    for x, y in batches:
        for k in range(2):
            counted.backward(counted(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
            counted.step()
    manual = _engine(stage)
    for x, y in batches:
        manual.set_gradient_accumulation_boundary(False)
        manual.backward(manual(x[:2], y[:2]))
        manual.set_gradient_accumulation_boundary(True)
        manual.backward(manual(x[2:], y[2:]))
        manual.step()  # one step() per accumulation window
        assert manual.was_step_applied()
    assert manual.global_steps == counted.global_steps == 2
    want, got = _params(counted), _params(manual)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    manual.set_gradient_accumulation_boundary(None)  # back to the counter
    assert not manual.is_gradient_accumulation_boundary()


def test_deepspeed_io_gives_micro_batches_of_this_ranks_share() -> None:
    engine = _engine()
    data = torch.utils.data.TensorDataset(torch.arange(10).float())
    evald = [b[0].tolist() for b in engine.deepspeed_io(data, route="eval")]
    assert evald == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # micro batch 2, in order
    train = engine.deepspeed_io(data)
    first = [b[0].tolist() for b in train]
    assert sorted(v for b in first for v in b) == list(range(10)) and len(first[0]) == 2
    assert first != evald  # the train route shuffles
    assert [len(b[0]) for b in engine.deepspeed_io(data, batch_size=4, route="predict")] == [4, 4, 2]
    sampler = torch.utils.data.SequentialSampler(range(4))
    assert [b[0].tolist() for b in engine.deepspeed_io(data, data_sampler=sampler)] == [[0, 1], [2, 3]]
    dropping = _engine(dataloader_drop_last=True)
    assert [len(b[0]) for b in dropping.deepspeed_io(data, batch_size=4, route="eval")] == [4, 4]
    with pytest.raises(ConfigError, match="must be a torch Dataset"):
        engine.deepspeed_io([1, 2, 3].__iter__())


def test_save_fp16_model_is_save_16bit_model(tmp_path) -> None:
    engine = _engine()
    assert engine.save_fp16_model(tmp_path) is True
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    want = engine.module.state_dict()
    assert set(saved) == set(want)
    for name in want:
        assert torch.equal(saved[name], want[name])


def test_empty_partition_cache_releases_gathered_stage3_params() -> None:
    engine = _engine(3, zero_optimization={"param_persistence_threshold": 10})
    (x, y), = global_batches(1, 4)
    for k in range(2):  # one window records the module order
        engine.backward(engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
        engine.step()
    engine(x[:2], y[:2])  # a forward that records gradients keeps its last modules gathered
    kept = [p for p in P.live_params() if any(p is q for q in engine.module.parameters())]
    assert kept, "expected gathered parameters after forward"
    engine.empty_partition_cache()
    assert not [p for p in P.live_params() if any(p is q for q in engine.module.parameters())]
    engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_load_module_state_dict_refreshes_the_masters(stage: int) -> None:
    engine = _engine(stage, optimizer={"type": "SGD", "params": {"lr": 0.0}},
                     zero_optimization={"param_persistence_threshold": 10})
    other = make_model(seed=5).state_dict()
    engine.load_module_state_dict({"module": other})
    (x, y), = global_batches(1, 4)
    for k in range(2):  # lr 0: the step must write the loaded weights back, not the old ones
        engine.backward(engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
        engine.step()
    assert engine.was_step_applied()
    got = _params(engine) if stage < 3 else _gathered(engine)
    for name, value in got.items():
        assert torch.equal(value, other[name]), name


def _gathered(engine):
    from shardwise.zero import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        return _params(engine)


def test_module_state_dict_can_leave_out_frozen_parameters() -> None:
    model = make_model()
    model.fc1.requires_grad_(False)
    engine, *_ = shardwise.initialize(model=model, config=engine_config(
        stage=1, micro=2, ga=1, clip=0.0, lr=1e-2))
    assert "fc1.weight" in engine.module_state_dict()
    state = engine.module_state_dict(exclude_frozen_parameters=True)
    assert "fc1.weight" not in state and "fc2.weight" in state


def test_attributes_deepspeed_scripts_read() -> None:
    engine = _engine()
    assert (engine.dp_world_size, engine.mp_world_size, engine.mpu) == (1, 1, None)
    assert engine.get_data_parallel_rank() == 0 and engine.get_model_parallel_rank() == 0
    assert engine.basic_optimizer is engine.optimizer.inner
    assert engine.zero_optimization() and not engine.zero_optimization_partition_gradients()
    assert engine.zero_reduce_bucket_size() == 200 and engine.gradient_clipping() == 0.0
    assert engine.optimizer_name() == "AdamW" and engine.optimizer_params()["lr"] == 1e-2


def test_dataloader_drop_last_reaches_initializes_loader_too() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10).float())
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "dataloader_drop_last": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    _, _, loader, _ = shardwise.initialize(model=make_model(), config=cfg, training_data=data)
    assert [len(b[0]) for b in loader] == [4, 4]
    assert not any("dataloader_drop_last" in w for w in load_config(cfg).warnings)


@pytest.mark.parametrize("stage", [2, 3])
def test_consolidated_16bit_state_dict_is_the_whole_module(stage: int) -> None:
    engine = _engine(stage, zero_optimization={"param_persistence_threshold": 10})
    (x, y), = global_batches(1, 4)
    for k in range(2):
        engine.backward(engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
        engine.step()
    state = engine._zero3_consolidated_16bit_state_dict()
    want = _params(engine) if stage < 3 else _gathered(engine)
    assert set(state) == set(want)
    for name in want:
        assert state[name].device.type == "cpu" and torch.equal(state[name].float(), want[name])


def test_config_queries_answer_from_the_config() -> None:
    engine = _engine(3, steps_per_print=7, gradient_clipping=0.5, gradient_predivide_factor=2.0,
                     checkpoint={"tag_validation": "fail"}, flops_profiler={"enabled": True},
                     zero_optimization={"reduce_bucket_size": 123, "prefetch_bucket_size": 456,
                                        "param_persistence_threshold": 78, "max_live_parameters": 910,
                                        "max_reuse_distance": 11, "sub_group_size": 12,
                                        "gather_16bit_weights_on_model_save": True,
                                        "offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    assert (engine.steps_per_print(), engine.gradient_clipping(), engine.gradient_predivide_factor()) \
        == (7, 0.5, 2.0)
    assert (engine.zero_reduce_bucket_size(), engine.zero_prefetch_bucket_size(),
            engine.zero_param_persistence_threshold(), engine.zero_max_live_parameters(),
            engine.zero_max_reuse_distance(), engine.zero_sub_group_size()) == (123, 456, 78, 910, 11, 12)
    assert engine.zero_optimization_partition_weights() and engine.zero_gather_16bit_weights_on_model_save()
    assert engine.zero_cpu_offload() and engine.zero_use_cpu_optimizer() and engine.zero_partial_offload() == 0.5
    assert engine.zero_overlap_comm() and engine.is_first_weights_partition_group()
    assert engine.checkpoint_tag_validation_enabled() and engine.checkpoint_tag_validation_fail()
    assert engine.flops_profiler_enabled() is True and engine.flops_profiler_profile_step() == 1
    assert engine.torch_autocast_lower_precision_safe_modules()[0] == "torch.nn.Linear"
    assert engine.get_data_types() == (torch.float32, torch.float32)
    assert engine.is_map_style_dataset(torch.utils.data.TensorDataset(torch.zeros(2)))
    engine.destroy()

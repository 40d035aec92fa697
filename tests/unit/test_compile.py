"""The ``compile`` section and ``engine.compile()`` on CPU.

Backends "aot_eager" and "eager" need no C++ compiler, so these run on any CI machine; the
inductor path is covered by its fallbacks (a missing compiler, a failing probe) and, on a GPU,
by the benchmark variants.
"""
from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.config import CompileConfig, load_config
from shardwise.errors import ConfigError
from shardwise.runtime import compile as C

import torch._dynamo  # noqa: F401  (a test dependency: missing fails)
if not torch._dynamo.is_dynamo_supported():  # e.g. a Python newer than this torch's dynamo
    pytest.skip("dynamo is not supported here", allow_module_level=True)

DIM, N_BLOCKS = 8, 3


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(DIM, DIM)
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


class Net(torch.nn.Module):
    """Embedding-free stand-in for a transformer: an input layer, repeated blocks, a head, and
    a second (smaller, mixed-class) ModuleList that must not be taken for the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, DIM)
        self.layers = torch.nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.extras = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.ReLU()])
        self.head = torch.nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.layers:
            h = block(h)
        for extra in self.extras:
            h = extra(h)
        return torch.nn.functional.mse_loss(self.head(h), y)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _config(stage: int = 2, **compile_section):
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 1_000_000}
    if compile_section:
        cfg["compile"] = compile_section
    return cfg


def _batches(n: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(n)]


def _train(engine, steps: int = 4):
    losses = []
    for x, y in _batches(steps):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in engine.module.parameters()]


def _compiled_names(module: torch.nn.Module):
    return {name for name, m in module.named_modules() if getattr(m, "_compiled_call_impl", None)}


# --- config ------------------------------------------------------------------------------
def test_compile_section_defaults_match_deepspeed_and_parse() -> None:
    default = load_config({"train_batch_size": 2}).compile
    assert (default.enabled, default.backend, default.kwargs, default.granularity) == (
        False, "inductor", {}, "blocks")
    cfg = load_config(_config(enabled=True, backend="aot_eager", granularity=" Module ",
                              kwargs={"mode": "default", "fullgraph": False}))
    assert cfg.compile.enabled and cfg.compile.backend == "aot_eager"
    assert cfg.compile.granularity == "module" and cfg.compile.kwargs == {"mode": "default",
                                                                         "fullgraph": False}
    assert not any("'compile'" in w for w in cfg.warnings)  # a real section, not "no effect"
    again = load_config(cfg.to_dict())
    assert again.compile == cfg.compile
    assert load_config({"train_batch_size": 2, "compile": None}).compile == CompileConfig()


@pytest.mark.parametrize("section,needle", [
    ({"granularity": "layers"}, "compile.granularity"),
    ({"kwargs": {"backend": "inductor"}}, "compile.backend"),
    ({"kwargs": {"modee": "max-autotune"}}, "'modee'"),
    ({"kwargs": ["mode"]}, "must be a dict"),
    ({"backend": ""}, "compile.backend"),
    ({"backend": 7}, "compile.backend"),
    ({"enabled": "sometimes"}, "compile.enabled"),
])
def test_bad_compile_values_are_config_errors_naming_the_key(section, needle) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_config(**section))
    assert needle in str(err.value)


def test_deepcompile_loads_quietly_and_its_tuning_keys_with_a_warning() -> None:
    cfg = load_config(_config(deepcompile=True, free_activation=True, offload_opt_states=False))
    warnings = " ".join(cfg.warnings)
    assert cfg.compile.deepcompile and "compile.deepcompile" not in warnings  # it means something
    assert "compile.free_activation" in warnings and "compile.offload_opt_states" in warnings
    assert "Unknown config key" not in warnings


def test_unknown_backend_name_is_a_config_error_at_compile_time() -> None:
    engine, *_ = shardwise.initialize(model=_model(), config=_config())
    with pytest.raises(ConfigError) as err:
        engine.compile(backend="no_such_backend")
    assert "no_such_backend" in str(err.value) and "aot_eager" in str(err.value)
    with pytest.raises(ConfigError, match="cannot be imported"):
        engine.compile(backend="no_such_pkg.fn")
    assert not engine.is_compiled


# --- what gets compiled ---------------------------------------------------------------------
def test_find_blocks_picks_the_largest_list_of_one_class() -> None:
    name, blocks = C.find_blocks(_model())
    assert name == "layers" and len(blocks) == N_BLOCKS
    assert C.find_blocks(torch.nn.Linear(2, 2)) == (None, [])


def test_blocks_granularity_compiles_exactly_the_blocks_in_place() -> None:
    model = _model()
    layers = list(model.layers)
    keys = list(model.state_dict())
    engine, *_ = shardwise.initialize(model=model, config=_config(enabled=True, backend="aot_eager"))
    assert engine.is_compiled
    assert _compiled_names(model) == {f"layers.{i}" for i in range(N_BLOCKS)}
    assert all(a is b for a, b in zip(model.layers, layers))  # same objects, same keys
    assert list(model.state_dict()) == keys
    result = engine._compile_result
    assert result.granularity == "blocks" and result.compiled == ("layers.0", "layers.1", "layers.2")


def test_module_granularity_compiles_the_root_only() -> None:
    model = _model()
    engine, *_ = shardwise.initialize(model=model, config=_config(
        enabled=True, backend="eager", granularity="module"))
    assert engine.is_compiled and _compiled_names(model) == {""}


def test_model_without_blocks_falls_back_to_the_whole_module() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    engine, *_ = shardwise.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "compile": {"enabled": True, "backend": "eager"}})
    assert engine.is_compiled and engine._compile_result.granularity == "module"
    assert _compiled_names(model) == {""}


# --- training is unchanged ------------------------------------------------------------------------
@pytest.mark.parametrize("stage,granularity", [(0, "blocks"), (2, "blocks"), (2, "module")])
def test_compiled_engine_trains_to_the_same_parameters(stage: int, granularity: str) -> None:
    eager, *_ = shardwise.initialize(model=_model(), config=_config(stage))
    ref_losses, ref_params = _train(eager)
    compiled, *_ = shardwise.initialize(model=_model(), config=_config(
        stage, enabled=True, backend="aot_eager", granularity=granularity))
    assert compiled.is_compiled
    losses, params = _train(compiled)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ref_params[0].ne(_model().inp.weight).any()  # the steps did change the weights


def test_the_compiled_blocks_are_what_runs_in_training() -> None:
    from torch._dynamo import lookup_backend
    runs = []

    def counting_aot_eager(gm, example_inputs):
        inner = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            runs.append(1)
            return inner(*args)
        return run

    engine, *_ = shardwise.initialize(model=_model(), config=_config())
    engine.compile(backend=counting_aot_eager)
    _train(engine, steps=3)
    # the probe's one call, then one graph per block call: no graph break, no eager fallback
    assert len(runs) == 1 + 3 * N_BLOCKS


def test_engine_compile_flips_is_compiled_and_a_second_call_keeps_the_first() -> None:
    engine, *_ = shardwise.initialize(model=_model(), config=_config())
    assert not engine.is_compiled and not _compiled_names(engine.module)
    engine.compile(backend="aot_eager", compile_kwargs={"fullgraph": False})
    assert engine.is_compiled and engine._compile_result.backend == "aot_eager"
    first = engine._compile_result
    engine.compile(backend="eager", granularity="module")
    assert engine._compile_result is first and "" not in _compiled_names(engine.module)
    _train(engine, steps=2)


# --- stage 3: each block one compiled region and one gather unit ---------------------------
def _stage3(**compile_section):
    cfg = _config(3, **compile_section)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every weight partitioned
    return cfg


def _gathered(engine):
    from shardwise.zero import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def test_stage3_compiles_each_block_forward_with_its_hooks_outside() -> None:
    eager, *_ = shardwise.initialize(model=_model(), config=_stage3())
    ref_losses, _ = _train(eager)
    model = _model()
    engine, *_ = shardwise.initialize(model=model,
                                      config=_stage3(enabled=True, backend="aot_eager"))
    result = engine._compile_result
    assert engine.is_compiled and result.zero3_units and result.granularity == "blocks"
    assert result.compiled == ("layers.0", "layers.1", "layers.2")
    assert not _compiled_names(model)  # the blocks' __call__ (and so their hooks) stays eager
    for block in model.layers:
        assert "forward" in block.__dict__ and block._forward_pre_hooks and block._forward_hooks
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in block.modules()
                       if m is not block)
    assert model.inp._forward_pre_hooks  # outside the blocks: gathered per module as before
    losses, _ = _train(engine)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for got, want in zip(_gathered(engine), _gathered(eager)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_deepcompile_compiles_at_initialize_and_a_later_plain_compile_is_quiet(monkeypatch) -> None:
    said = []
    monkeypatch.setattr(C, "warn_once", said.append)
    engine, *_ = shardwise.initialize(model=_model(), config=_stage3(deepcompile=True,
                                                                     backend="aot_eager"))
    first = engine._compile_result
    assert engine.is_compiled and first.zero3_units
    assert engine.is_deepcompile_enabled() and engine.is_deepcompile_active()
    engine.compile()  # what a DeepSpeed DeepCompile script calls next
    assert engine._compile_result is first and not said
    engine.compile(backend="eager")
    assert engine._compile_result is first and "already compiled" in said[0]


def test_stage3_module_granularity_and_cuda_graph_modes_are_switched_off(monkeypatch) -> None:
    from shardwise.runtime import compile_zero3 as Z
    said = []
    monkeypatch.setattr(Z, "warn_once", said.append)
    engine, *_ = shardwise.initialize(model=_model(), config=_stage3(
        enabled=True, backend="aot_eager", granularity="module"))
    assert engine._compile_result.granularity == "blocks" and "granularity 'module'" in said[0]
    assert Z.zero3_kwargs({"mode": "reduce-overhead", "fullgraph": True}) == {"fullgraph": True}
    assert Z.zero3_kwargs({"mode": "max-autotune"}) == {"mode": "max-autotune-no-cudagraphs"}
    assert Z.zero3_kwargs({"options": {"triton.cudagraphs": True}}) == {
        "options": {"triton.cudagraphs": False}}
    assert Z.zero3_kwargs({"mode": "default"}) == {"mode": "default"}
    assert sum("CUDA graphs" in w for w in said) == 3


def test_a_whole_model_compiled_by_its_user_under_stage3_trains_like_eager() -> None:
    """torch.compile(engine.module) bypasses the engine's compile: dynamo must not trace the
    stage-3 hooks (it did, and backward then failed on a weight swapped under it)."""
    from torch._dynamo.utils import counters
    eager, *_ = shardwise.initialize(model=_model(), config=_stage3())
    ref_losses, _ = _train(eager)
    engine, *_ = shardwise.initialize(model=_model(), config=_stage3())
    torch._dynamo.reset()
    compiled = torch.compile(engine.module, backend="aot_eager")
    breaks = sum(counters["graph_break"].values())
    losses = []
    for x, y in _batches(4):
        loss = compiled(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert sum(counters["graph_break"].values()) > breaks  # the hooks ran outside the graphs
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for got, want in zip(_gathered(engine), _gathered(eager)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_stage3_model_without_blocks_stays_eager_with_the_reason() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    engine, *_ = shardwise.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "compile": {"enabled": True, "backend": "aot_eager"}})
    assert not engine.is_compiled and "no nn.ModuleList of repeated blocks" in \
        engine._compile_result.skipped_reason
    assert all(m._forward_pre_hooks for m in model.modules())  # gathered per module, as eager
    loss = torch.nn.functional.mse_loss(engine(torch.randn(2, 4)), torch.zeros(2, 2))
    engine.backward(loss)
    engine.step()


def test_inductor_without_a_cpu_compiler_stays_eager(monkeypatch) -> None:
    import shardwise.report_checks as checks
    monkeypatch.setattr(checks, "cpu_compiler", lambda: None)
    engine, *_ = shardwise.initialize(model=_model(), config=_config(enabled=True))
    assert engine._compile_result.skipped_reason.startswith("inductor on CPU")
    assert not engine.is_compiled and not _compiled_names(engine.module)
    _train(engine, steps=1)


def test_a_failing_probe_keeps_the_model_eager(monkeypatch) -> None:
    def broken_backend(gm, example_inputs):
        raise RuntimeError("toolchain exploded")

    engine, *_ = shardwise.initialize(model=_model(), config=_config())
    engine.compile(backend=broken_backend)
    assert not engine.is_compiled
    assert "toolchain exploded" in engine._compile_result.skipped_reason
    _train(engine, steps=1)


def test_blocks_under_activation_checkpointing_stay_eager() -> None:
    cfg = _config(enabled=True, backend="aot_eager")
    cfg["activation_checkpointing"] = {"modules": ["Block"]}
    eager_cfg = _config()
    eager_cfg["activation_checkpointing"] = {"modules": ["Block"]}
    ref_losses, ref_params = _train(shardwise.initialize(model=_model(), config=eager_cfg)[0])
    engine, *_ = shardwise.initialize(model=_model(), config=cfg)
    assert not engine.is_compiled and not _compiled_names(engine.module)
    assert "activation_checkpointing" in engine._compile_result.skipped_reason
    losses, params = _train(engine)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


# --- the Hugging Face loss function ---------------------------------------------------------
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _train_lm(engine, steps: int = 3):
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 96, (4, 12), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [2, 3])
def test_blocks_granularity_compiles_the_hf_loss_and_trains_like_eager(stage: int) -> None:
    from torch._dynamo import lookup_backend
    graphs = []

    def recording_aot_eager(gm, example_inputs):
        graphs.append({n.target for n in gm.graph.nodes if n.op == "call_function"})
        return lookup_backend("aot_eager")(gm, example_inputs)

    eager, *_ = shardwise.initialize(model=_tiny_llama(), config=_config(stage))
    ref_losses, ref_params = _train_lm(eager)
    model = _tiny_llama()
    engine, *_ = shardwise.initialize(model=model, config=_config(stage))
    engine.compile(backend=recording_aot_eager)
    assert engine._compile_result.loss == ("",)
    assert getattr(model.loss_function, "_torchdynamo_orig_callable", None) is not None
    assert type(model).loss_function is not model.loss_function  # the class keeps its own
    losses, params = _train_lm(engine)
    # a graph holding the cross entropy was built: the compiled loss is what ran
    assert any(torch.nn.functional.cross_entropy in g for g in graphs)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_model_without_a_loss_function_compiles_only_its_blocks() -> None:
    engine, *_ = shardwise.initialize(model=_model(), config=_config(enabled=True, backend="aot_eager"))
    assert engine.is_compiled and engine._compile_result.loss == ()

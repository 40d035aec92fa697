"""The ``fp8`` section on CPU: it validates, picks the right linear layers, and errors clearly
where FP8 cannot run (no torchao, a CPU, a GPU before Ada/Hopper). Stage 3 + fp8 trains in
tests/distributed/test_fp8_zero3.py."""
from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.config import load_config
from shardwise.errors import ConfigError, UnsupportedFeatureError
from shardwise.precision import fp8

BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=128))


def test_section_defaults_and_spellings() -> None:
    assert not load_config(dict(BASE)).fp8.enabled
    cfg = load_config({**BASE, "fp8": {"enabled": True, "recipe": " RowWise ",
                                        "skip_modules": ["down_proj", "model.layers.0.*"]}})
    assert (cfg.fp8.enabled, cfg.fp8.recipe) == (True, "rowwise")
    assert cfg.fp8.skip_modules == ["down_proj", "model.layers.0.*"]
    assert load_config({**BASE, "fp8": {"enabled": True}}).fp8.recipe == "tensorwise"


@pytest.mark.parametrize("section, match", [
    ({"recipe": "delayed"}, r"fp8\.recipe = 'delayed'.*'tensorwise', 'rowwise'"),
    ({"recipe": 3}, r"fp8\.recipe = 3 is not a recipe"),
    ({"skip_modules": "lm_head"}, r"fp8\.skip_modules = 'lm_head' \(str\) must be a list"),
    ({"skip_modules": ["ok", 7]}, r"fp8\.skip_modules: .*\[7\]"),
    ({"enabled": "maybe"}, r"fp8\.enabled"),
    ({"reciep": "rowwise"}, r"fp8\.recipe"),  # a typo is an error naming the real key
])
def test_bad_section_is_a_config_error(section, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config({**BASE, "fp8": {"enabled": True, **section}})


def test_plan_skips_head_named_modules_and_odd_dims() -> None:
    model = tiny_llama()
    model.model.layers[0].odd = torch.nn.Linear(32, 24)  # 24 is not a multiple of 16
    plan = fp8.plan_fp8(model, ["model.layers.1.*", "gate_proj"])
    assert plan.skipped["lm_head"].startswith("output head")
    assert "multiples of 16" in plan.skipped["model.layers.0.odd"]
    assert "'gate_proj'" in plan.skipped["model.layers.0.mlp.gate_proj"]
    assert "'model.layers.1.*'" in plan.skipped["model.layers.1.self_attn.q_proj"]
    assert set(plan.convert) == {f"model.layers.0.{n}" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.up_proj", "mlp.down_proj")}
    assert not any("embed" in n for n in plan.convert)  # embeddings are no nn.Linear anyway


def test_initialize_without_torchao_names_the_pip_install(monkeypatch) -> None:
    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install torchao"):
        shardwise.initialize(model=tiny_llama(), config={**BASE, "fp8": {"enabled": True}})


def test_initialize_on_cpu_says_fp8_needs_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(fp8, "torchao_available", lambda: True)
    with pytest.raises(UnsupportedFeatureError, match=r"computes on cpu.*compute capability >= 8\.9"):
        shardwise.initialize(model=tiny_llama(), config={**BASE, "fp8": {"enabled": True}})


def test_fp8_off_leaves_the_model_alone() -> None:
    engine, *_ = shardwise.initialize(model=tiny_llama(), config={**BASE, "fp8": {"enabled": False}})
    assert not any(type(m).__name__ == "Float8Linear" for m in engine.module.modules())


def _fake_gpu(monkeypatch, capability) -> torch.device:
    monkeypatch.setattr(fp8, "torchao_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    return torch.device("cuda", 0)


def test_gpu_before_ada_is_refused(monkeypatch) -> None:
    device = _fake_gpu(monkeypatch, (8, 0))
    with pytest.raises(UnsupportedFeatureError, match=r"Fake GPU has compute capability 8\.0"):
        fp8.check_fp8_available(device)


def test_hopper_and_ada_pass_the_check(monkeypatch) -> None:
    for capability in ((9, 0), (8, 9), (10, 0)):
        fp8.check_fp8_available(_fake_gpu(monkeypatch, capability))


def test_no_convertible_layer_is_an_error(monkeypatch) -> None:
    device = _fake_gpu(monkeypatch, (9, 0))
    model = tiny_llama()
    with pytest.raises(ConfigError, match=r"no nn\.Linear of the model can use FP8"):
        fp8.apply_fp8(model, "tensorwise", ["model.layers.*"], device)


def test_conversion_keeps_parameter_names_shapes_and_objects() -> None:
    # the module swap runs on CPU; the FP8 matmuls themselves are tested in tests/gpu
    model = tiny_llama()
    before = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    plan = fp8.plan_fp8(model)
    assert fp8.convert_fp8(model, plan, "rowwise") == len(plan.convert) == 14
    assert {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()} == before
    assert [id(p) for p in model.parameters()] == params  # the optimizer's list stays valid
    assert type(model.lm_head).__name__ == "Linear"


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_engine_trains_fp8_and_its_checkpoint_loads_without_fp8(tmp_path, monkeypatch, stage) -> None:
    # torch's CPU _scaled_mm runs the FP8 matmuls here; the platform check is what refuses
    # CPUs for users, so it is bypassed for this test of the engine wiring only
    monkeypatch.setattr(fp8, "check_fp8_available", lambda device: None)
    cfg = {**BASE, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           "fp8": {"enabled": True, "recipe": "tensorwise"}}
    engine, *_ = shardwise.initialize(model=tiny_llama(), config=cfg)
    assert sum(type(m).__name__ == "Float8Linear" for m in engine.module.modules()) == 14
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    engine.save_checkpoint(str(tmp_path), tag="t")
    plain_cfg = {k: v for k, v in cfg.items() if k != "fp8"}
    plain, *_ = shardwise.initialize(model=tiny_llama(), config=plain_cfg)
    plain.load_checkpoint(str(tmp_path), tag="t")
    from shardwise.zero import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):  # stage 3: the whole tensors
        saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with GatheredParameters(list(plain.module.parameters())):
        loaded = {k: v.clone() for k, v in plain.module.state_dict().items()}
    assert loaded.keys() == saved.keys()
    assert all(v.numel() > 0 for v in saved.values())
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)

"""Hybrid Engine (issue 23) in one process: config, generate == plain reference, freshness
after optimizer steps, parity with an engine that never generated, LoRA, memory release."""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise
from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.runtime.hybrid_engine import HybridEngine
from tests.distributed._hybrid import config, scenario
from tests.unit._inference_models import prompts, tiny


def _check(result) -> None:
    for got, want in zip(result["tokens"], result["reference"]):
        assert torch.equal(got, want), (got, want)
    assert not torch.equal(result["tokens"][0], result["tokens"][-1]), \
        "training changed nothing the greedy tokens see: the freshness check would be vacuous"
    assert result["losses"] == result["twin_losses"]
    for name, w in result["weights"].items():
        assert torch.equal(w, result["twin_weights"][name]), name


def test_config_keys_and_defaults_are_deepspeeds():
    cfg = load_config({"train_batch_size": 1}).hybrid_engine
    assert (cfg.enabled, cfg.max_out_tokens, cfg.inference_tp_size, cfg.release_inference_cache,
            cfg.pin_parameters, cfg.tp_gather_partition_size) == (False, 512, 1, False, True, 8)
    loaded = load_config({"train_batch_size": 1, "hybrid_engine": {"enabled": True}})
    assert not any("hybrid_engine" in w for w in loaded.warnings)


@pytest.mark.parametrize("family,stage", [pytest.param("llama", 3, marks=pytest.mark.windows),
                                          ("opt", 3), ("llama", 2), ("opt", 2), ("gpt2", 1)])
def test_generate_matches_reference_before_and_after_steps(family, stage):
    _check(scenario(0, 1, family, stage))


def test_gather_by_layer_groups_and_released_cache():
    # pin_parameters false: layers gathered 1 at a time; release_inference_cache: copy freed
    result = scenario(0, 1, "llama", 3, {"pin_parameters": False, "tp_gather_partition_size": 1,
                                         "release_inference_cache": True})
    _check(result)


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_and_parameter_offload(stage):
    # stage 3: offload_optimizer + offload_param to CPU; stage 2: offload_optimizer
    _check(scenario(0, 1, "opt", stage, offload=True))


def test_release_inference_cache_frees_the_copy_and_training_weights_stay_partitioned():
    model = tiny("llama")
    engine, *_ = shardwise.initialize(model=model, config=config(3, {"release_inference_cache": True}))
    assert isinstance(engine, HybridEngine)
    ids, mask = prompts(2)
    engine.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert engine._copy is None
    assert all(p.numel() == 0 for p in engine.module.parameters()), "gathered values not released"
    keep, *_ = shardwise.initialize(model=tiny("llama"), config=config(3, {}))
    keep.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert keep._copy is not None and keep.generate_stats["copy_bytes"] > 0


def test_inference_tp_size_larger_than_the_world_is_a_clear_error():
    with pytest.raises(ConfigError, match="inference_tp_size = 2"):
        shardwise.initialize(model=tiny("llama"), config=config(3, {"inference_tp_size": 2}))


def test_latency_counters_and_eval_print(capsys):
    engine, *_ = shardwise.initialize(model=tiny("llama"), config=config(2, {}))
    ids, mask = prompts(1)
    engine.eval()
    engine.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert engine._generate_latency > 0 and engine._gather_latency >= 0
    engine.train()
    engine.eval()
    line = capsys.readouterr().out
    assert "|E2E latency=" in line and "|Generate time=" in line and "|Training time=" in line


def test_unsupported_generate_settings_fall_back_to_hf_generate():
    model = tiny("llama")
    ref = copy.deepcopy(model)
    engine, *_ = shardwise.initialize(model=model, config=config(3, {}))
    ids, mask = prompts(2)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    assert torch.equal(got, want)


def _lora_model():
    import peft
    model = tiny("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                           init_lora_weights=False)
    torch.manual_seed(3)
    return peft.get_peft_model(model, lora)


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_fused_generation_equals_merged_model(stage):
    model = _lora_model()
    merged = copy.deepcopy(model).merge_and_unload()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = shardwise.initialize(model=model, config=config(stage, {}))
    ids, mask = prompts(2)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=6)
    want = merged.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    plain = copy.deepcopy(merged)
    for layer in plain.modules():  # the adapters change the tokens: the check is not vacuous
        if hasattr(layer, "q_proj"):
            layer.q_proj.weight.data.zero_()
    assert not torch.equal(plain.generate(ids, attention_mask=mask, max_new_tokens=6), want)
    # training weights stay unfused
    from tests.distributed._hybrid import gathered_weights
    after = gathered_weights(engine)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert not engine.is_lora_fused


def test_fuse_and_unfuse_lora_weight_in_place():
    model = _lora_model()
    merged = copy.deepcopy(model).merge_and_unload()
    engine, *_ = shardwise.initialize(model=model, config=config(2, {}))
    engine.fuse_lora_weight()
    assert engine.is_lora_fused
    base = engine.module.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert torch.allclose(base, merged.model.layers[0].self_attn.q_proj.weight)
    engine.unfuse_lora_weight()
    assert not engine.is_lora_fused


@pytest.mark.parametrize("options,new", [("attention=reduction+gemv=reduction", 4),
                                         ("kv_bucket=16", 20)])  # 20 new: two buckets
def test_decode_options_reach_the_inference_copy_and_tokens_stay_the_references(options, new):
    from shardwise.inference.options import DecodeOptions
    model = tiny("llama")
    reference = copy.deepcopy(model)
    engine, *_ = shardwise.initialize(model=model, config=config(3, {}))
    assert isinstance(engine, HybridEngine)
    engine.decode_options = DecodeOptions.parse(options)
    ids, mask = prompts(2)
    engine.eval()
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert engine._copy.decoder.options == DecodeOptions.parse(options)
    want = reference.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert torch.equal(got, want)

"""The flops profiler: exact parameter counts and analytic MACs (an MLP, a tiny Llama with
grouped-query attention), DeepSpeed's counting rules and strings, the FlopsProfiler API, the
report, the peak table, and the config-driven profile written at ``profile_step``."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import shardwise
from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.profiling.flops_profiler import FlopsProfiler, get_model_profile
from shardwise.profiling.peak_flops import device_peak_flops, peak_flops_for_name
from tests.distributed._parity import HID, IN, OUT, engine_config, global_batches, make_model


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))


def test_mlp_params_macs_and_flops_follow_deepspeeds_rules() -> None:
    model = _mlp()
    batch = 4
    flops, macs, params = get_model_profile(model, input_shape=(batch, 16), print_profile=False,
                                            as_string=False)
    assert params == 16 * 32 + 32 + 32 * 8  # biases are parameters
    # Linear: input numel x out_features, bias add not counted
    assert macs == batch * 16 * 32 + batch * 32 * 8
    # FLOPs = 2 x MACs, plus one per element of the ReLU's output
    assert flops == 2 * macs + batch * 32
    assert get_model_profile(model, input_shape=(batch, 16), print_profile=False) == (
        "6.27 K", "3.07 KMACs", "800")


def _tiny_llama(kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=128,
                      max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg), cfg


def _llama_macs(cfg, batch: int, seq: int) -> int:
    """Analytic forward MACs: every projection (q, k, v, o, gate, up, down), the LM head, and
    attention's QK^T and AV over the query heads and the full s x s matrix."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    per_token_layer = h * h + 2 * h * kv + h * h + 3 * h * inter
    tokens = batch * seq
    linear = tokens * (layers * per_token_layer + h * cfg.vocab_size)
    attention = layers * 2 * batch * cfg.num_attention_heads * seq * seq * head_dim
    return linear + attention


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_tiny_llama_exact_params_and_analytic_macs(kv_heads: int) -> None:
    model, cfg = _tiny_llama(kv_heads)
    batch, seq = 2, 16
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    flops, macs, params = get_model_profile(model, kwargs={"input_ids": ids}, print_profile=False,
                                            as_string=False, warm_up=0)
    assert params == sum(p.numel() for p in model.parameters())
    assert macs == _llama_macs(cfg, batch, seq)
    # elementwise work (norms, SiLU, rotary, residuals, softmax-free SDPA) is a few percent
    assert 2 * macs < flops < 2.2 * macs
    assert model.training  # the train/eval mode is restored


def test_flops_profiler_api_resets_per_start_and_reports_per_module(tmp_path) -> None:
    model = _mlp()
    x = torch.randn(4, 16)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    model(x)  # counts accumulate until stop
    prof.stop_profile()
    assert prof.get_total_macs() == 2 * (4 * 16 * 32 + 4 * 32 * 8)
    assert prof.get_total_duration() > 0
    assert prof.get_total_params(as_string=True) == "800"
    assert prof.module_flops_macs(model[0])[1] == 2 * 4 * 16 * 32
    out = tmp_path / "sub" / "profile.txt"
    text = prof.print_model_profile(profile_step=7, output_file=str(out))
    assert out.read_text() == text
    assert "Profile Summary at step 7:" in text
    assert re.search(r"params per GPU:\s+800", text)
    assert re.search(r"fwd MACs per GPU:\s+6.14 KMACs", text)
    # the detailed tree: each module with params, MACs, latency, FLOPS and its own repr
    assert re.search(r"\(0\): Linear\(544 = 68% Params, 4.1 KMACs = 66.67% MACs, .* latency, .*FLOPS, "
                     r"in_features=16, out_features=32, bias=True\)", text)
    assert "depth 1:" in text and "'Linear': '800'" in text
    prof.start_profile()  # a new start resets the counts
    model(x)
    prof.stop_profile()
    assert prof.get_total_macs() == 4 * 16 * 32 + 4 * 32 * 8
    prof.end_profile()
    assert prof.print_model_profile() is None  # nothing to report after end_profile
    assert not model._forward_hooks and not model[0]._forward_pre_hooks  # hooks removed


def test_sdpa_and_conv_are_counted() -> None:
    class Attn(nn.Module):
        def forward(self, q, k, v):
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              enable_gqa=True)

    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    _, macs, _ = get_model_profile(Attn(), args=[q, k, v], print_profile=False, as_string=False)
    assert macs == 2 * (2 * 4 * 8 * 8 * 16)  # QK^T and AV over the 4 query heads
    conv = nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False)
    _, macs, params = get_model_profile(conv, input_shape=(1, 3, 10, 10), print_profile=False,
                                        as_string=False)
    assert params == 8 * 3 * 9 and macs == 10 * 10 * 8 * 3 * 9


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(shardwise.ShardwiseError, match="input_shape"):
        get_model_profile(_mlp(), input_shape=[4, 16])
    with pytest.raises(shardwise.ShardwiseError, match="give the model's inputs"):
        get_model_profile(_mlp())


def test_peak_table() -> None:
    assert peak_flops_for_name("NVIDIA H200") == 989.5e12
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989.5e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("NVIDIA A10G") is None
    assert peak_flops_for_name("Some New Chip") is None
    assert device_peak_flops(torch.device("cpu")) is None


def test_config_section_defaults_and_validation() -> None:
    cfg = load_config({"train_batch_size": 1})
    fp = cfg.flops_profiler
    assert (fp.enabled, fp.recompute_fwd_factor, fp.profile_step, fp.module_depth,
            fp.top_modules, fp.detailed, fp.output_file) == (False, 0.0, 1, -1, 1, True, None)
    cl = cfg.comms_logger
    assert (cl.enabled, cl.verbose, cl.prof_all, cl.prof_ops, cl.debug) == (False, False, True, [], False)
    assert load_config({"train_batch_size": 1, "flops_profiler": None}).flops_profiler.enabled is False
    with pytest.raises(ConfigError, match="top_modules"):
        load_config({"train_batch_size": 1, "flops_profiler": {"top_modules": 0}})
    with pytest.raises(ConfigError, match="prof_ops"):
        load_config({"train_batch_size": 1, "comms_logger": {"prof_ops": [1, 2]}})


def test_engine_writes_the_profile_at_profile_step(tmp_path) -> None:
    out = tmp_path / "flops.txt"
    micro, ga = 4, 2
    cfg = engine_config(stage=2, micro=micro, ga=ga, clip=0.0, lr=1e-2, flops_profiler={
        "enabled": True, "profile_step": 2, "output_file": str(out), "detailed": False})
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    assert isinstance(engine.flops_profiler, FlopsProfiler)
    written_at = None
    for x, y in global_batches(4, micro * ga):
        for k in range(ga):
            loss = engine(x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro])
            engine.backward(loss)
            engine.step()
        if written_at is None and out.exists():
            written_at = engine.global_steps
    # global_steps == 2 during the third optimizer step; the report follows its update
    assert written_at == 3
    text = out.read_text()
    assert "Profile Summary at step 2:" in text
    macs = micro * (IN * HID + HID * HID + HID * OUT)  # one micro batch, per GPU
    assert re.search(rf"fwd MACs per GPU:\s+{round(macs / 1e3, 2):g} KMACs", text)
    assert re.search(r"batch size per GPU:\s+4", text)
    for label in ("bwd latency:", "step latency:", "iter latency:", "FLOPS per GPU = 3 * fwd"):
        assert label in text
    assert "Detailed Profile" not in text  # detailed: false
    assert engine.flops_profiler.started is False  # ended after the report


def test_engine_without_the_section_has_no_profiler() -> None:
    cfg = engine_config(stage=0, micro=2, ga=1, clip=0.0, lr=1e-2)
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    assert engine.flops_profiler is None
    x, y = global_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    assert not engine.module._forward_pre_hooks


def test_zero3_profile_counts_full_parameters() -> None:
    # partitioned parameters hold empty .data between uses; "params per GPU" is the model's
    cfg = engine_config(stage=3, micro=4, ga=1, clip=0.0, lr=1e-2,
                        zero_optimization={"stage3_param_persistence_threshold": 0},
                        flops_profiler={"enabled": True, "profile_step": 0, "detailed": False})
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    x, y = global_batches(1, 4)[0]
    engine.backward(engine(x, y))
    engine.step()
    assert all(p.numel() == 0 for p in engine.module.parameters())
    result = engine._profile.result
    assert result.params == sum(p.numel() for p in make_model().parameters())
    assert result.macs == 4 * (IN * HID + HID * HID + HID * OUT)

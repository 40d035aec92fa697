"""The memory estimator: DeepSpeed's published numbers, the ZeRO formula, and real CPU measurements."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import shardwise
from shardwise.errors import ConfigError
from shardwise.profiling import estimate_cli
from shardwise.profiling.memory_estimator import (GiB, estimate_activations, estimate_memory,
                                                  estimate_zero2_model_states_mem_needs,
                                                  estimate_zero3_model_states_mem_needs, model_shape)

import transformers


def _llama_config(**overrides):
    base = dict(hidden_size=64, num_hidden_layers=3, intermediate_size=176, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, use_cache=False)
    base.update(overrides)
    return transformers.LlamaConfig(**base)


def test_zero2_matches_deepspeed_docs_t5_3b():
    # DeepSpeed's memory docs: t5-3b (2851598336 params), 1 node x 8 GPUs.
    psi = 2851598336
    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, 8, 1, cpu_offload=True)
    assert (round(cpu / GiB, 2), round(gpu / GiB, 2)) == (127.48, 5.31)
    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, 8, 1, cpu_offload=False)
    assert (round(cpu / GiB, 2), round(gpu / GiB, 2)) == (127.48, 15.93)


def test_zero3_matches_deepspeed_output_t5_small():
    # Published output for t5-small: 60M params, 16M largest layer (the shared embedding).
    psi, layer = 60506624, 16449536
    expected = {(True, True): (1.52, 0.06), (True, False): (1.35, 0.17), (False, False): (0.09, 1.08)}
    for (offload, offload_params), want in expected.items():
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(psi, layer, 1, 1, offload, offload_params, True)
        assert (round(cpu / GiB, 2), round(gpu / GiB, 2)) == want
    cpu, _, _ = estimate_zero3_model_states_mem_needs(psi, layer, 1, 1, False, False, zero_init=False)
    assert round(cpu / GiB, 2) == 0.34


def test_rows_follow_zero_formula_over_stage_divisor():
    est = estimate_memory(_llama_config(), num_gpus=4, num_nodes=2, precision="bf16", micro_batch=1, seq_len=8,
                          device_memory=10 * GiB, host_memory=10 * GiB)
    psi, layer, n = est.shape.total_params, est.shape.largest_layer_params, 8
    for stage, (dp, dg, do) in {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}.items():
        row = est.row(stage)
        extra = 2 * layer if stage == 3 else 0
        assert row.params == int(2 * psi / dp + extra)
        assert row.grads == int(2 * psi / dg + extra)
        assert row.optimizer == int(12 * psi / do)
    off = est.row(2, "optimizer")
    assert off.optimizer == 0 and off.host == int((12 * psi / n + 4 * psi / n) * 4)
    assert est.row(3, "optimizer+param").params == 2 * layer
    assert {(r.stage, r.offload) for r in est.rows} >= {(0, "none"), (3, "optimizer+param")}
    assert (0, "optimizer") not in {(r.stage, r.offload) for r in est.rows}
    assert all(r.fits for r in est.rows)
    tight = estimate_memory(_llama_config(), num_gpus=4, num_nodes=2, stages=(0, 3), device_memory=est.row(3).device_total,
                            host_memory=GiB, micro_batch=1, seq_len=8)
    assert tight.row(3).fits and not tight.row(0).fits
    assert "stage" in est.table() and json.loads(est.to_json())["rows"][0]["device_total"] > 0


def test_model_config_object_path_and_meta_module_agree(tmp_path):
    cfg = _llama_config()
    real = transformers.LlamaForCausalLM(cfg)
    want = sum(p.numel() for p in real.parameters())
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    shapes = [model_shape(cfg), model_shape(path), model_shape(meta), model_shape(real)]
    assert {s.total_params for s in shapes} == {want}
    assert shapes[0].num_layers == 3 and shapes[0].num_kv_heads == 2 and shapes[0].gated_mlp
    with pytest.raises(ConfigError, match="does not exist"):
        model_shape(tmp_path / "nope.json")


def _tensor_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_model_states_match_a_real_cpu_training_step():
    """fp32 AdamW: params + grads + optimizer state bytes vs the stage-0 row (within 10%)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    params = _tensor_bytes(model.parameters())
    grads = _tensor_bytes(p.grad for p in model.parameters())
    states = _tensor_bytes(v for s in opt.state.values() for v in s.values()
                           if isinstance(v, torch.Tensor) and v.numel() > 1)
    row = estimate_memory(model, stages=(0,), offload=("none",), precision="fp32").row(0)
    for measured, estimated in ((params, row.params), (grads, row.grads), (states, row.optimizer)):
        assert abs(estimated - measured) <= 0.1 * measured


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_activations_match_saved_tensor_bytes_of_a_real_llama(dtype, precision):
    cfg = _llama_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    b, s = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_storages:  # weights (and their transposed views) are not activations
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    saved[out.logits.untyped_storage().data_ptr()] = out.logits.untyped_storage().nbytes()
    measured = sum(saved.values())
    estimated = estimate_activations(model_shape(model), b, s, precision).device
    assert abs(estimated - measured) <= 0.1 * measured
    # Checkpointing every block must estimate less, and the kept boundaries land on the host with cpu.
    full = estimate_activations(model_shape(model), b, s, precision, "full")
    cpu = estimate_activations(model_shape(model), b, s, precision, "cpu")
    assert full.device < estimated and cpu.device < full.device and cpu.host > 0


def test_cli_prints_table_and_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    _llama_config().to_json_file(str(path))
    assert estimate_cli.main(["--model-config", str(path), "--gpus", "2", "--micro-batch", "2", "--seq", "16",
                              "--device-memory", "1", "--deepspeed-tables"]) == 0
    text = capsys.readouterr().out
    assert "optimizer+param" in text and "per CPU  |  per GPU" in text
    assert estimate_cli.main(["--model-config", str(path), "--json", "--stages", "2", "--offload", "none"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["stage"], r["offload"]) for r in data["rows"]] == [(2, "none")]
    assert estimate_cli.main(["--model-config", str(tmp_path / "missing.json")]) == 2


def test_public_names_and_deepspeed_live_tables(capsys):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_llama_config())
    rows2 = shardwise.estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    rows3 = shardwise.estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    assert len(rows2) == 2 and len(rows3) == 6
    assert "largest layer params" in capsys.readouterr().out
    assert shardwise.estimate_memory(model, micro_batch=1, seq_len=8).rows

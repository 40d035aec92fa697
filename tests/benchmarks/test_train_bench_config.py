"""train_bench's fairness pieces, on CPU without running a model: every variant gets the same
optimizer settings spelled out, and the loss-agreement table computes what it says."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _loss_agreement as la  # noqa: E402
import train_bench as tb  # noqa: E402
from _common import BenchConfig  # noqa: E402


def test_engine_config_spells_out_what_decides_learning() -> None:
    cfg = BenchConfig(lr=3e-4, weight_decay=0.1, grad_clip=1.0, adam_eps=1e-6, betas=(0.9, 0.95))
    ds = tb.engine_config(cfg, tb.ZERO_SECTIONS["z2"])
    # DeepSpeed >= 0.19.6 clips at 1.0 when the key is missing: it must always be present
    assert ds["gradient_clipping"] == 1.0
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}}
    # DeepSpeed's bf16 default accumulates gradients in bf16; FSDP2 and shardwise in fp32
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["bf16"] == {"enabled": True}
    assert tb.engine_config(BenchConfig(), tb.ZERO_SECTIONS["z2"])["gradient_clipping"] == 0.0
    # a variant's own top-level keys still win (the bf16-accumulation variant)
    bf16acc = tb.engine_config(cfg, tb.ZERO_SECTIONS["z2_offload_bf16acc"])
    assert bf16acc["data_types"] == {"grad_accum_dtype": "bf16"}
    assert "_top" not in bf16acc["zero_optimization"]


def test_torch_variants_use_the_engines_adamw_settings() -> None:
    cfg = BenchConfig(weight_decay=0.0)
    kwargs = tb.adamw_kwargs(cfg)
    assert kwargs["weight_decay"] == 0.0  # not torch.optim.AdamW's 0.01 default
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], **kwargs)
    group = opt.param_groups[0]
    ds_params = tb.engine_config(cfg, tb.ZERO_SECTIONS["z2"])["optimizer"]["params"]
    for key in ("lr", "eps", "weight_decay"):
        assert group[key] == ds_params[key]
    assert list(group["betas"]) == ds_params["betas"]


def test_clip_gradients_follows_grad_clip() -> None:
    model = torch.nn.Linear(4, 4, bias=False)
    model.weight.grad = torch.full((4, 4), 10.0)
    tb.clip_gradients(model, BenchConfig(grad_clip=0.0))
    assert torch.equal(model.weight.grad, torch.full((4, 4), 10.0))
    tb.clip_gradients(model, BenchConfig(grad_clip=1.0))
    assert math.isclose(model.weight.grad.norm().item(), 1.0, rel_tol=1e-5)


def test_bench_config_json_round_trip_keeps_betas_a_tuple() -> None:
    cfg = BenchConfig(betas=(0.8, 0.9), grad_clip=0.5)
    assert BenchConfig.from_json(cfg.to_json()) == cfg


def test_loss_steps_raise_the_step_count() -> None:
    args = tb.parse_args(["--device", "cpu", "--warmup", "3", "--steps", "10",
                          "--loss-steps", "50"])
    cfg = tb.config_from_args(args)
    assert cfg.warmup + cfg.steps == 50


def _row(name: str, curve: list[float], error: str | None = None) -> dict:
    row = {"variant": name, "loss_curve": curve}
    if error:
        row["error"] = error
    return row


def test_loss_agreement_max_delta_first_last_and_verdict() -> None:
    ref = [10.0, 9.0, 8.0, 7.0]
    results = [_row("fsdp2", ref), _row("sw_z2", [10.0, 9.01, 8.02, 7.0]),
               _row("ds_z2", [10.0, 9.2, 8.1, 7.3, 6.0]), _row("broken", [1.0], error="boom")]
    rows = {r.variant: r for r in la.loss_agreement(results, steps=50, tolerance=0.05)}
    assert set(rows) == {"fsdp2", "sw_z2", "ds_z2"}  # errored rows are left out
    assert rows["fsdp2"].reference == "fsdp2" and rows["fsdp2"].max_abs_delta == 0.0
    assert rows["sw_z2"].max_abs_delta == pytest.approx(0.02)
    assert rows["sw_z2"].mean_abs_delta == pytest.approx(0.0075)
    assert rows["sw_z2"].agrees
    ds = rows["ds_z2"]
    assert ds.steps == 4  # capped at the shorter curve
    assert (ds.loss_first, ds.loss_last) == (10.0, 7.3)
    assert ds.max_abs_delta == pytest.approx(0.3) and not ds.agrees


def test_loss_agreement_steps_cap_and_nan_never_agrees() -> None:
    results = [_row("fsdp2", [5.0, 4.0, 3.0]), _row("sw_z2", [5.0, 4.0, 99.0]),
               _row("nan", [5.0, float("nan"), 3.0])]
    rows = {r.variant: r for r in la.loss_agreement(results, steps=2)}
    assert rows["sw_z2"].agrees and rows["sw_z2"].steps == 2  # step 3 not compared
    assert not rows["nan"].agrees and math.isinf(rows["nan"].max_abs_delta)


def test_reference_choice() -> None:
    curves = {"sw_z2": [1.0], "torch": [1.0]}
    assert la.pick_reference(curves) == "sw_z2"
    assert la.pick_reference(curves, "torch") == "torch"
    assert la.pick_reference({"x": [1.0]}) == "x"
    assert la.pick_reference({}) is None
    with pytest.raises(ValueError, match="--loss-ref 'fsdp2'"):
        la.pick_reference(curves, "fsdp2")


def test_annotate_and_table_rows() -> None:
    results = [_row("fsdp2", [2.0, 1.0]), _row("sw_z2", [2.0, 1.5])]
    rows = la.loss_agreement(results, steps=2, tolerance=0.1)
    la.annotate(results, rows)
    assert results[1]["loss_max_delta"] == pytest.approx(0.5) and not results[1]["loss_agrees"]
    verdicts = {r["variant"]: r["verdict"] for r in la.table_rows(rows)}
    assert verdicts == {"fsdp2": "ok", "sw_z2": "DIFFERS"}


def test_round_weights_to_bf16_makes_the_casts_lossless() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    before = model.weight.detach().clone()
    tb.round_weights_to_bf16(model)
    w = model.weight.detach()
    assert w.dtype == torch.float32 and not torch.equal(w, before)
    assert torch.equal(w.to(torch.bfloat16).float(), w)  # a bf16 cast no longer changes it
    assert torch.allclose(w, before, rtol=1e-2)


def test_fp32_buffers_cast_by_an_engine_are_restored() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=64))
    saved = tb.fp32_buffers(model)
    exact = model.model.rotary_emb.inv_freq.clone()
    model.to(torch.bfloat16)  # what DeepSpeed's and shardwise's bf16 setup do
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    restored = tb.restore_fp32_buffers(model, saved)
    assert "model.rotary_emb.inv_freq" in restored
    assert torch.equal(model.model.rotary_emb.inv_freq, exact)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # parameters untouched
    assert tb.restore_fp32_buffers(model, saved) == []  # nothing left to restore

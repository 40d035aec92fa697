"""fp8_bench's corpus and run plan on CPU (the runs themselves need an FP8 GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_bench  # noqa: E402


def test_stdlib_corpus_is_deterministic_bytes_and_batches_repeat() -> None:
    corpus = fp8_bench.stdlib_corpus(max_bytes=2 << 20)
    assert corpus.dtype == torch.uint8 and corpus.numel() >= 1 << 20
    assert b"def " in bytes(corpus[:200_000].tolist())  # real Python source
    cfg = fp8_bench.BenchConfig(vocab=256, seq=64, micro_batch=3)
    a, b = fp8_bench.batch_at(corpus, 7, cfg), fp8_bench.batch_at(corpus, 7, cfg)
    assert a.shape == (3, 64) and a.dtype == torch.long and torch.equal(a, b)
    assert int(a.max()) < 256
    assert not torch.equal(a, fp8_bench.batch_at(corpus, 8, cfg))  # a new batch per step


def test_plan_quick_and_full() -> None:
    quick = dict(fp8_bench.plan(fp8_bench.parse_args(["--quick"])))
    assert quick["1.1b"].steps >= 300 and quick["1.1b"].hidden == 2048
    assert (quick["7b"].hidden, quick["7b"].intermediate, quick["7b"].layers) == (4096, 11008, 4)
    full = dict(fp8_bench.plan(fp8_bench.parse_args(["--layers-7b", "32"])))
    assert full["7b"].layers == 32 and full["7b"].vocab == 256
    cfg = fp8_bench.engine_config(full["1.1b"], fp8=True, recipe="rowwise")
    assert cfg["fp8"] == {"enabled": True, "recipe": "rowwise"} and cfg["compile"]["enabled"]
    assert "fp8" not in fp8_bench.engine_config(full["1.1b"], fp8=False, recipe="rowwise")


def test_both_precisions_warm_the_learning_rate_up_alike() -> None:
    import shardwise

    cfg = fp8_bench.BenchConfig(vocab=256, seq=16, micro_batch=2, lr=3e-4)
    config = fp8_bench.engine_config(cfg, fp8=False, recipe="tensorwise", lr_warmup=10)
    assert config["scheduler"]["params"]["warmup_max_lr"] == 3e-4
    assert "scheduler" not in fp8_bench.engine_config(cfg, False, "tensorwise", lr_warmup=0)
    config.pop("compile")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    engine, _, _, scheduler = shardwise.initialize(model=model, config=config)
    lrs = []
    for _ in range(12):
        engine.backward(engine(torch.randn(2, 8)).square().mean())
        engine.step()
        lrs.append(engine.optimizer.param_groups[0]["lr"])
    assert lrs[0] < lrs[4] < lrs[8] < 3e-4 and lrs[11] == 3e-4  # linear, then flat

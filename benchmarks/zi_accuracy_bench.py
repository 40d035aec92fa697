"""ZeRO-Inference's weight-only quantized streaming: the perplexity it costs, on real text.

``zero_inference_bench.py`` times random-init models, whose perplexity means nothing. This
benchmark trains a small Llama on bytes of Python's standard library (no downloads: byte-level
tokens, vocabulary 256), then runs the same weights through ``shardwise.init_inference`` with
``offload_param`` to the CPU, unquantized and with DeepSpeed's ``weight_quantization``
(``num_bits`` 8 and 4, ``group_size`` 64), and measures perplexity on text training never saw:
the corpus's last ``--heldout-kb`` KiB and ``shardwise.inference.quant.FIXED_TEXT``.

    python benchmarks/zi_accuracy_bench.py                  # CPU, a few minutes
    python benchmarks/zi_accuracy_bench.py --steps 5        # a smoke run

Rows: ``plain`` (the trained model's own forward), ``zi`` (streamed, not quantized: must
equal ``plain``), ``zi_int8``, ``zi_int4``; each with its perplexity delta against ``plain``.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402

from _common import stdlib_corpus  # noqa: E402

VARIANTS = {"zi": None, "zi_int8": 8, "zi_int4": 4}


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        tie_word_embeddings=False))


def train(model: torch.nn.Module, corpus: torch.Tensor, args: argparse.Namespace) -> List[float]:
    """Plain-torch AdamW on random windows of ``corpus`` (seeded), linear warm-up; losses."""
    from tqdm import tqdm
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    losses = []
    model.train()
    for step in tqdm(range(args.steps), desc="train", disable=not sys.stderr.isatty()):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / max(1, args.steps // 10))
        starts = torch.randint(0, corpus.numel() - args.seq - 1, (args.batch,), generator=gen)
        ids = torch.stack([corpus[s:s + args.seq] for s in starts.tolist()]).long()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def windows(data: torch.Tensor, seq: int) -> torch.Tensor:
    """``data`` cut into whole windows of ``seq`` tokens (at least one)."""
    n = max(1, data.numel() // seq)
    return data[:n * seq].reshape(n, -1).long()


def zi_engine(model: torch.nn.Module, bits: Any):
    """The ZeRO-Inference route: stage 3 + ``offload_param`` cpu, every decoder layer streamed
    (persistence threshold below a layer's matrices), optionally weight-quantized."""
    import shardwise
    extra = {}
    if bits is not None:
        extra["weight_quantization"] = {"quantized_initialization": {"num_bits": bits,
                                                                     "group_size": 64}}
    zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
            "stage3_param_persistence_threshold": 1000}
    return shardwise.init_inference(copy.deepcopy(model), dtype="fp32", zero=zero, **extra)


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    from shardwise.inference.quant import FIXED_TEXT, perplexity
    corpus = stdlib_corpus(max_bytes=args.corpus_mb << 20)
    held = args.heldout_kb << 10
    train_part, heldout = corpus[:-held], corpus[-held:]
    texts = {"heldout": windows(heldout, args.seq),
             "fixed_text": torch.tensor(list(FIXED_TEXT.encode()), dtype=torch.long)[None]}
    model = build(args)
    start = time.perf_counter()
    losses = train(model, train_part, args)
    train_s = time.perf_counter() - start
    model.eval()
    with torch.no_grad():  # every held-out window in one forward per variant
        rows = [{"variant": "plain", "bits": 32,
                 **{t: perplexity(lambda x: model(x).logits, ids) for t, ids in texts.items()}}]
        for name, bits in VARIANTS.items():
            engine = zi_engine(model, bits)
            row = {"variant": name, "bits": bits or 32,
                   "bytes_per_pass": engine.streamer.bytes_per_pass}
            row.update({t: perplexity(lambda x: engine(x).logits, ids) for t, ids in texts.items()})
            engine.streamer.close()
            rows.append(row)
    for row in rows:
        for t in texts:
            row[f"{t}_rel"] = row[t] / rows[0][t] - 1.0
    n_params = sum(p.numel() for p in model.parameters())
    return {"params": n_params, "steps": args.steps, "train_s": train_s,
            "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
            "corpus_bytes": corpus.numel(), "heldout_bytes": held, "rows": rows}


def print_table(result: Dict[str, Any]) -> None:
    print(f"\nLlama {result['params'] / 1e6:.2f}M parameters, {result['steps']} steps on "
          f"{result['corpus_bytes'] / 2**20:.0f} MiB of stdlib bytes ({result['train_s']:.0f} s), "
          f"loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}")
    plain = result["rows"][0]
    print(f"{'variant':9} {'weights':>8} {'ppl heldout':>11} {'delta':>8} {'ppl fixed':>9} "
          f"{'delta':>8} {'MB/pass':>8}")
    for r in result["rows"]:
        mb = f"{r['bytes_per_pass'] / 1e6:8.2f}" if "bytes_per_pass" in r else f"{'-':>8}"
        weights = "fp32" if r["bits"] == 32 else f"int{r['bits']}"
        print(f"{r['variant']:9} {weights:>8} {r['heldout']:11.4f} {r['heldout_rel']:+8.2%} "
              f"{r['fixed_text']:9.4f} {r['fixed_text_rel']:+8.2%} {mb}")
    print(f"(plain = the trained model's own forward: heldout ppl {plain['heldout']:.4f})")


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--corpus-mb", type=int, default=8)
    p.add_argument("--heldout-kb", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for the result")
    args = p.parse_args(argv)
    result = measure(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

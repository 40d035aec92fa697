"""The child side of infer_bench: one unit (a size, one or more variants, batch sizes) in one
process, one ``ROW {json}`` line per (variant, batch) as soon as it is measured, so a unit cut
off by its timeout keeps the rows it finished.

A failure to build a variant's engine (DeepSpeed's kernel injection on GQA / transformers 5)
becomes that variant's rows with the exact error; a failed generate becomes that row's error.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

from _child_run import LLAMA_SHAPES

SIZES: Dict[str, Dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    **{k: LLAMA_SHAPES[k] for k in ("1.1b", "7b")},
}
COMPILED = ("hf_static", "sw_inject", "sw_int8")


def copy_bandwidth(torch: Any, device: str) -> Optional[float]:
    """Device-to-device copy bandwidth in bytes/s (read + write), None off CUDA."""
    if device != "cuda":
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 20
    del x, y
    return 2 * (1 << 30) / seconds


def build_model(torch: Any, size: str, device: str) -> Any:
    """Random-init Llama of ``size``, built directly in bf16 on CUDA (fp32 on CPU), eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=4096, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    return model.eval()


def base_variant(variant: str) -> str:
    """``sw_inject@attention=split`` -> ``sw_inject``."""
    return variant.partition("@")[0]


def variant_options(variant: str) -> str:
    """``sw_inject@gemv=reduction/attention=split`` -> ``gemv=reduction+attention=split``."""
    return variant.partition("@")[2].replace("/", "+")


def make_engine(variant: str, model: Any, torch: Any, max_tokens: int, device: str,
                decode: str = "") -> Any:
    """The variant's engine around ``model``; ``decode``: DecodeOptions for shardwise's step."""
    dtype = "bf16" if device == "cuda" else "fp32"
    if variant.startswith("hf"):
        return model
    if variant.startswith("ds"):
        import deepspeed
        return deepspeed.init_inference(model, dtype=torch.bfloat16, max_out_tokens=max_tokens,
                                        replace_with_kernel_inject=variant == "ds_inject")
    import shardwise
    if variant == "sw_eager":
        return shardwise.init_inference(model, dtype=dtype)
    engine = shardwise.init_inference(model, dtype="int8" if variant == "sw_int8" else dtype,
                                      replace_with_kernel_inject=True, max_out_tokens=max_tokens)
    if decode and engine.decoder is not None and device == "cuda":  # decode_probe's winner
        from shardwise.inference.options import DecodeOptions
        engine.decoder.set_options(DecodeOptions.parse(decode))
        engine.decoder.compile_step(engine.cuda_graph)
    return engine


def _perplexity(torch: Any, model: Any, size: str, device: str) -> float:
    """Perplexity on quant.FIXED_TEXT as byte ids (no tokenizer; the same tokens every run)."""
    from shardwise.inference.quant import FIXED_TEXT, perplexity
    ids = torch.tensor([list(FIXED_TEXT.encode("utf-8"))], device=device) % SIZES[size]["vocab_size"]
    return perplexity(lambda x: model(x).logits, ids)


def _timed(torch: Any, engine: Any, ids: Any, new: int, extra: Dict, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, **extra)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_batch(torch: Any, engine: Any, variant: str, size: str, batch: int, args: Any,
                  setup_s: float) -> Dict[str, Any]:
    """One row: warm-up (compile / capture), first-token latency, decode tokens/s, peak memory."""
    ids = torch.randint(0, SIZES[size]["vocab_size"], (batch, args.prompt), device=args.device)
    extra = {"cache_implementation": "static"} if variant == "hf_static" else {}
    t0 = time.perf_counter()
    compiled = base_variant(variant) in COMPILED
    _timed(torch, engine, ids, args.new if compiled else 2, extra, args.device)
    row: Dict[str, Any] = {"cold_start_s": setup_s + time.perf_counter() - t0}
    if variant == "hf_static":  # transformers compiles after its first call
        _timed(torch, engine, ids, args.new, extra, args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    repeats = args.repeats if compiled else 1  # eager rows: one timed call (tens of ms per step)
    first = min(_timed(torch, engine, ids, 1, extra, args.device) for _ in range(repeats))
    total = min(_timed(torch, engine, ids, args.new, extra, args.device) for _ in range(repeats))
    decode = total - first
    if decode <= 0:  # timer noise on a tiny CPU run: fall back to the whole call per token
        decode = total * (args.new - 1) / args.new
    steps = args.new - 1
    row.update(prefill_ms=first * 1000, first_token_ms=first * 1000,
               ms_per_token=decode / steps * 1000, tok_s=batch * steps / decode,
               seq_tok_s=steps / decode)
    if args.device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def _note(exc: BaseException) -> str:
    """The exception as one line (DeepSpeed's messages span lines), for a row's error note."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:400]


def _emit(row: Dict[str, Any]) -> None:
    print("ROW " + json.dumps(row), flush=True)


def run_unit(size: str, variants: List[str], batches: List[int], args: Any) -> None:
    """Build the model once; for each variant its engine, then each batch size: one row each."""
    import torch
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(key, value)
    bandwidth = copy_bandwidth(torch, args.device)
    t0 = time.perf_counter()
    model = build_model(torch, size, args.device)
    build_s = time.perf_counter() - t0
    bf16_bytes = sum(p.numel() * 2 for p in model.parameters())  # bf16 weights read per step
    for variant in variants:
        base = {"size": size, "variant": variant}
        t1 = time.perf_counter()
        try:
            ppl = _perplexity(torch, model, size, args.device) if variant == "sw_int8" else None
            decode = variant_options(variant) or (args.decode if variant.startswith("sw") else "")
            engine = make_engine(base_variant(variant), model, torch, args.prompt + args.new,
                                 args.device, decode)
            extra: Dict[str, Any] = {}
            if ppl is not None:  # int8's accuracy cost on a fixed text (random weights: relative)
                after = _perplexity(torch, engine.module, size, args.device)
                extra = dict(ppl_bf16=ppl, ppl_int8=after, ppl_delta_rel=(after - ppl) / ppl,
                             weight_bytes_own=_stored_bytes(engine.module))
        except Exception as exc:  # DeepSpeed injection: the exact error is the row's note
            for batch in batches:
                _emit({**base, "batch": batch, "error": _note(exc)})
            continue
        setup_s = build_s + time.perf_counter() - t1
        for batch in batches:
            row = {**base, "batch": batch}
            try:
                row.update(measure_batch(torch, engine, variant, size, batch, args, setup_s))
            except Exception as exc:
                row["error"] = _note(exc)
            row.update(extra, weight_bytes=bf16_bytes)
            if decode and base_variant(variant) in ("sw_inject", "sw_int8"):
                row["decode"] = decode
            if bandwidth and "tok_s" in row:
                bound = bandwidth / bf16_bytes
                row.update(copy_tb_s=bandwidth / 1e12, hbm_bound_tok_s=bound,
                           hbm_fraction=row["seq_tok_s"] / bound)
            _emit(row)
            if args.device == "cuda":
                torch.cuda.empty_cache()
        del engine


def _stored_bytes(module: Any) -> int:
    """Bytes of the module's parameters and buffers (the int8 weights + what stays bf16)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total

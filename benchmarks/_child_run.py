"""One benchmark variant in a fresh process, the tokens/s ratio between two rows, the shapes.

The inference-side benchmarks (infer_bench, zero_inference_bench, rlhf_bench) run every
(size, variant, batch) in its own process so allocator state and compiled graphs never carry
over; the child prints one JSON line last, which becomes the row.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any, Dict, List, Optional, Sequence

#: the Llama shapes the inference-side benchmarks share (random init; LlamaConfig kwargs)
LLAMA_SHAPES: Dict[str, Dict[str, int]] = {
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=40, vocab_size=32000),
}


def child_env() -> Dict[str, str]:
    """This environment for a benchmark child, with ``TORCH_CUDA_ARCH_LIST`` entries stripped of
    their feature suffix ("9.0a" -> "9.0"): DeepSpeed 0.19.8's op builder parses each entry as
    integers and fails on the H200 image's "9.0a" before it JIT-builds an op (measured there:
    its hybrid engine and kernel injection die with ``invalid literal for int() ... '0a'``)."""
    env = dict(os.environ)
    archs = env.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        entries = archs.replace(" ", ";").split(";")
        env["TORCH_CUDA_ARCH_LIST"] = ";".join(
            re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", e.strip()) for e in entries if e.strip())
    return env


def run_child(cmd: Sequence[str], key: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Run ``cmd``; its last JSON line, or ``key`` with the error (timeout, last stderr lines)."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                              env=child_env())
    except subprocess.TimeoutExpired:
        return {**key, "error": f"timeout {timeout}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {**key, "error": " | ".join(tail)[-300:]}


def same_point(rows: List[Dict[str, Any]], row: Dict[str, Any],
               variant: str) -> Optional[Dict[str, Any]]:
    """The row of ``variant`` at ``row``'s size and batch, if there is one."""
    for other in rows:
        if (other["size"], other["batch"], other["variant"]) == (row["size"], row["batch"], variant):
            return other
    return None


def tok_s_ratio(rows: List[Dict[str, Any]], row: Dict[str, Any], variant: str) -> str:
    """``row``'s tokens/s over ``variant``'s at the same size and batch ("-" when missing)."""
    other = same_point(rows, row, variant)
    if other is None or not other.get("tok_s") or not row.get("tok_s"):
        return "-"
    return f"{row['tok_s'] / other['tok_s']:.2f}x"

"""The rows of ``zero_inference_bench.py --plan NAME`` (priority order) and a time model per
row, so a run with ``--budget-s`` skips what no longer fits instead of being killed mid-row.

The estimate of a row: process start (imports, CUDA init, the H2D measurement), the model
build, and ``4 + new`` forward passes (the engine's probe, a 2-token warm-up, a 1-token and a
``new``-token generate), each one pass over the streamed bytes at the assumed link speed,
plus three prefills' compute. Assumptions (one H200, pinned PCIe ~50 GB/s): below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Union

START_S = 14.0          # python + torch/transformers imports, CUDA init, the 1 GiB H2D test
LINK = 50e9             # pinned host -> device, B/s
PIN = 5e9               # pinned host allocation + fill, B/s
DISK = 1.6e9            # direct reads/writes of the GPU machine's virtio disk, B/s
HOST_BUILD = 1.5e9      # the baselines' whole host model (tiled random block), B/s
DS_INIT = 1.0e9         # DeepSpeed ZeRO-3 partitioning the host model into pinned memory, B/s
ACCEL_LINK = 8e9        # Accelerate cpu_offload: pageable per-module copies, B/s
DS_EFF = {"1.1b": 0.12, "7b": 0.55}  # DeepSpeed's fraction of the link (issue 22's numbers)
FLOPS = 4e14            # prefill compute, bf16 FLOP/s
FORMAT = {"bf16": 1.0, "int8": 0.53, "int4": 0.28}  # bytes over the link vs bf16


@dataclass(frozen=True)
class Row:
    """One child process: a size, a variant, a batch (or "auto") and the new tokens."""

    size: str
    variant: str
    batch: Union[int, str]
    new: int


PLANS: Dict[str, List[Row]] = {
    # issue 22's targets in one ~9-minute device call, most important first: 7B bf16/int4 at
    # batch 1 and 16, 1.1B bf16 and the DeepSpeed rows they are compared with, the 70B int4
    # generate, then int8, Accelerate, NVMe, kv_offload at the large batch.
    "issue22": [
        Row("7b", "sw_cpu_bf16", 1, 32),
        Row("7b", "sw_cpu_int4", 1, 32),
        Row("7b", "sw_cpu_bf16", 16, 32),
        Row("1.1b", "sw_cpu_bf16", 1, 32),
        Row("7b", "ds_z3", 1, 12),
        Row("1.1b", "ds_z3", 1, 12),
        Row("70b", "sw_cpu_int4", 1, 8),
        Row("7b", "sw_cpu_int8", 1, 32),
        Row("7b", "sw_cpu_int4", 16, 32),
        Row("7b", "hf_accel", 1, 6),
        Row("7b", "sw_cpu_int8", 16, 32),
        Row("7b", "sw_nvme_bf16", 1, 4),
        Row("7b", "sw_cpu_bf16_kv", 64, 12),
        Row("7b", "sw_cpu_bf16", 64, 12),
        Row("7b", "ds_z3", 16, 6),
    ],
    # the rows the 2026-12-06 issue22 call did not finish (the NVMe row's disk read, the kv
    # row's timeout, the batch-64 and DeepSpeed batch-16 rows its budget skipped)
    "issue22b": [
        Row("7b", "sw_nvme_bf16", 1, 4),
        Row("7b", "sw_cpu_bf16", 64, 12),
        Row("7b", "ds_z3", 16, 6),
        Row("7b", "sw_nvme_int4", 1, 8),
        Row("7b", "sw_cpu_bf16_kv", 64, 8),
    ],
    "smoke": [Row("tiny", v, 2, 4) for v in ("sw_cpu_bf16", "sw_cpu_int4", "sw_nvme_bf16",
                                             "sw_cpu_bf16_kv")],
}


def _params(shape: Dict[str, int]) -> Dict[str, float]:
    h, f = shape["hidden_size"], shape["intermediate_size"]
    heads, kv, n = shape["num_attention_heads"], shape["num_key_value_heads"], shape["num_hidden_layers"]
    layers = n * (2 * h * h + 2 * h * (h // heads) * kv + 3 * h * f)
    return {"layers": layers, "total": layers + 2 * h * shape["vocab_size"],
            "kv_per_pos": 2 * n * kv * (h // heads)}


def estimate_s(row: Row, sizes: Dict[str, Dict[str, Any]], prompt: int) -> float:
    """Seconds the row should take (see the module docstring)."""
    p = _params(sizes[row.size])
    bf16 = 2 * p["layers"]
    batch = 64 if row.batch == "auto" else int(row.batch)
    passes = 4 + row.new
    prefill = 3 * 2 * p["total"] * batch * prompt / FLOPS
    if row.variant.startswith("sw_"):
        fmt = row.variant.split("_")[2]
        step = bf16 * FORMAT[fmt]
        nvme = "_nvme_" in row.variant
        build = 3 + bf16 / 20e9 + step / (DISK if nvme else PIN)
        pass_s = step / (DISK if nvme else LINK)
        if row.variant.endswith("_kv"):
            kv = 2 * p["kv_per_pos"] * batch * (prompt + row.new)
            build += kv / PIN
            pass_s += kv / LINK
        return START_S + build + passes * pass_s + prefill
    build = 2 * p["total"] / HOST_BUILD
    if row.variant == "ds_z3":
        build += 2 * p["total"] / DS_INIT
        pass_s = bf16 / (LINK * DS_EFF.get(row.size, 0.5))
    else:
        pass_s = bf16 / ACCEL_LINK
    return START_S + build + passes * pass_s + prefill

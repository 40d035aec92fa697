"""Dense bf16/fp16 tensor-core peaks of known accelerators, for MFU.

MFU (model FLOPs utilisation) = achieved model FLOP/s / the device's peak. The peaks are the
vendors' dense (not 2:4-sparse) bf16 figures for the SXM/OAM parts unless the name says
otherwise. ``SHARDWISE_PEAK_TFLOPS`` overrides the table (an unknown part, a clock-capped
one, or a different precision); a CPU has no entry (None: MFU is not reported).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

#: (substrings that must all appear in the device name, lower case) -> peak FLOP/s.
#: Checked in order, so the more specific names come first; None: known, but no figure.
PEAK_BF16_FLOPS: Sequence[Tuple[Tuple[str, ...], Optional[float]]] = (
    (("gb200",), 2500e12),
    (("b200",), 2250e12),
    (("h200",), 989.5e12),
    (("h100", "pcie"), 756e12),
    (("h100", "nvl"), 835e12),
    (("h100",), 989.5e12),
    (("h800",), 989.5e12),
    (("gh200",), 989.5e12),
    (("a100",), 312e12),
    (("a800",), 312e12),
    (("l40s",), 362e12),
    (("l40",), 181e12),
    (("l4",), 121e12),
    (("a10g",), None),  # AWS part, no published bf16 peak: set SHARDWISE_PEAK_TFLOPS
    (("a10",), 125e12),
    (("a6000",), 154.8e12),
    (("4090",), 165.2e12),
    (("3090",), 71e12),
    (("v100",), 125e12),  # fp16 (V100 has no bf16)
    (("t4",), 65e12),  # fp16
    (("mi300x",), 1307.4e12),
)


def peak_flops_for_name(name: str) -> Optional[float]:
    """The table's peak for a device name such as ``torch.cuda.get_device_name()``."""
    lowered = name.lower()
    for needles, peak in PEAK_BF16_FLOPS:
        if all(n in lowered for n in needles):
            return peak
    return None


def device_peak_flops(device: Optional[torch.device] = None) -> Optional[float]:
    """Peak FLOP/s of ``device`` (default: the current accelerator), None when unknown or CPU."""
    override = os.environ.get("SHARDWISE_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device is None:
        from ..accelerator import get_accelerator
        device = get_accelerator().device()
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))

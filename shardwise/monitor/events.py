"""Monitor events: DeepSpeed's ``(tag, value, step)`` tuples, the tag names the engine writes,
and values that stay on the device until the monitor flushes (no host sync per step)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Protocol, Sequence, Tuple, Union

import torch

# DeepSpeed's tags (x axis: global samples)
TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
ELAPSED_PREFIX = "Train/Samples/elapsed_time_ms_"
# ours, under the same prefix so DeepSpeed-style scripts find them next to the others
GRAD_NORM = "Train/Samples/global_grad_norm"
SAMPLES_PER_SEC = "Train/Samples/samples_per_sec"
TOKENS_PER_SEC = "Train/Samples/tokens_per_sec"
MFU = "Train/Samples/mfu"
GPU_PEAK_MEMORY = "Train/Samples/gpu_peak_memory_gib"
HOST_RSS = "Train/Samples/host_rss_gib"

#: DeepSpeed's global timer names -> the suffix of their ``elapsed_time_ms_*`` tag.
ELAPSED_TAGS = {"fwd": "forward", "bwd": "backward", "bwd_inner": "backward_inner",
                "bwd_allreduce": "backward_allreduce", "step": "step",
                # ours (offload copies, monitor/copy_timers.py)
                "offload_d2h": "offload_d2h", "offload_h2d": "offload_h2d"}


class Waitable(Protocol):
    def wait(self) -> Any: ...


@dataclass(frozen=True)
class DeviceScalar:
    """A 0-d tensor that may still be computing (on a side stream: ``ready`` is waited for
    before the read). Read once, at flush time."""

    tensor: torch.Tensor
    ready: Optional[Waitable] = None

    def read(self) -> float:
        if self.ready is not None:
            self.ready.wait()
        return float(self.tensor)


Value = Union[float, int, torch.Tensor, DeviceScalar]
Event = Tuple[str, Value, int]


def resolve(events: Sequence[Event]) -> List[Tuple[str, float, int]]:
    """Turn every value into a float: all plain device tensors are read with one host copy."""
    for _, v, _ in events:
        if isinstance(v, DeviceScalar) and v.ready is not None:
            v.ready.wait()
    tensors = [v.tensor if isinstance(v, DeviceScalar) else v for _, v, _ in events
               if torch.is_tensor(v) or isinstance(v, DeviceScalar)]
    read: dict = {}
    if tensors:
        by_device: dict = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        for group in by_device.values():
            values = torch.stack([t.detach().float().reshape(()) for t in group]).tolist()
            read.update({id(t): v for t, v in zip(group, values)})
    out = []
    for tag, value, step in events:
        if isinstance(value, DeviceScalar):
            value = value.tensor
        if torch.is_tensor(value):
            value = read[id(value)]
        out.append((str(tag), float(value), int(step)))
    return out


def check_events(events: Iterable[Any]) -> List[Event]:
    """``write_events`` input check: a list of (tag: str, value, step: int) tuples."""
    checked = []
    for i, event in enumerate(events):
        if not (isinstance(event, (tuple, list)) and len(event) == 3 and isinstance(event[0], str)):
            raise TypeError(f"monitor.write_events(): event {i} is {event!r}; each event is a "
                            f"(tag: str, value: float, step: int) tuple, e.g. "
                            f"('Train/Samples/my_metric', 0.5, engine.global_samples)")
        checked.append((event[0], event[1], event[2]))
    return checked


def csv_file_name(tag: str) -> str:
    """DeepSpeed's CSV file name of a tag: '/' and spaces become '_', plus '.csv'."""
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


def csv_header(tag: str) -> str:
    """DeepSpeed's value column name: the last '/'-separated part of the tag."""
    return tag.split("/")[-1]

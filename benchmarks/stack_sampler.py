"""Where each Python thread's wall time goes, by sampling its stack (a poor man's py-spy).

The torch profiler sees operators, not the Python between them, and its own per-operator
cost inflates exactly the host overhead one wants to measure. This samples
``sys._current_frames()`` every ``interval`` seconds from a daemon thread and counts, per
thread, which shardwise function was running: the *entry* (outermost shardwise frame: the
hook or engine method that was called) and the *leaf* (innermost shardwise frame), plus
the innermost frame of any file. A sample counts wall time: a thread blocked in a C call
(an event wait, a copy) or waiting for the GIL shows the frame that made the call.

Threads that run no Python at a sample (autograd's device thread between hooks, a worker
blocked outside Python) are not counted at that sample, so a thread's share is of the
samples taken, and "python %" says how often it was in Python at all.

    with StackSampler() as s:
        train_a_few_steps()
    print(s.summary())
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Dict, Optional, Tuple

PACKAGE = "shardwise"


def _where(frame: FrameType) -> str:
    path = Path(frame.f_code.co_filename)
    return f"{'/'.join(path.parts[-2:])}:{frame.f_code.co_name}"


def classify(frame: Optional[FrameType], package: str = PACKAGE) -> Tuple[str, str, str]:
    """(entry, leaf, innermost) of one stack: the outermost and innermost frames whose file
    lies in ``package`` ("-" when none), and the innermost frame of any file."""
    entry = leaf = "-"
    innermost = _where(frame) if frame is not None else "-"
    marker = f"{package}/"
    while frame is not None:
        if marker in frame.f_code.co_filename.replace("\\", "/"):
            here = _where(frame)
            if leaf == "-":
                leaf = here
            entry = here
        frame = frame.f_back
    return entry, leaf, innermost


class StackSampler:
    """Samples every thread's Python stack while the ``with`` block runs."""

    def __init__(self, interval: float = 0.0005, package: str = PACKAGE) -> None:
        self.interval = interval
        self.package = package
        self.samples = 0
        self.per_thread: Counter = Counter()
        self.entries: Dict[str, Counter] = {}
        self.leaves: Dict[str, Counter] = {}
        self.innermost: Dict[str, Counter] = {}
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _name(self, ident: int, names: Dict[int, str]) -> str:
        # threads that torch starts in C++ (autograd's device threads) have no threading name
        return names.get(ident, f"native-{ident % 10000}")

    def sample_once(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        self.samples += 1
        for ident, frame in sys._current_frames().items():
            if ident == me or frame is None:
                continue
            name = self._name(ident, names)
            entry, leaf, inner = classify(frame, self.package)
            self.per_thread[name] += 1
            self.entries.setdefault(name, Counter())[entry] += 1
            self.leaves.setdefault(name, Counter())[leaf] += 1
            self.innermost.setdefault(name, Counter())[inner] += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            time.sleep(self.interval)

    def __enter__(self) -> "StackSampler":
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.seconds = time.perf_counter() - self._t0

    def summary(self, rows: int = 12) -> str:
        """Per thread (most sampled first): its share of samples by entry, leaf and innermost
        frame, each as a percentage of all samples (= of the wall time)."""
        if not self.samples:
            return "no samples"
        lines = [f"stack samples: {self.samples} over {self.seconds:.2f} s "
                 f"({self.samples / max(self.seconds, 1e-9):.0f}/s)"]
        for name, n in self.per_thread.most_common():
            lines.append(f"\n[{name}] in Python {100 * n / self.samples:.1f}% of samples")
            for title, table in (("entry (outermost shardwise frame)", self.entries[name]),
                                 ("leaf (innermost shardwise frame)", self.leaves[name]),
                                 ("innermost frame", self.innermost[name])):
                lines.append(f"  {title}:")
                for where, k in table.most_common(rows):
                    lines.append(f"    {100 * k / self.samples:6.1f}%  {where}")
        return "\n".join(lines)

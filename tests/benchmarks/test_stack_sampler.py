"""benchmarks/stack_sampler.py: which function each thread's wall time is in, by sampling."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import stack_sampler as ss  # noqa: E402

# this file lies in tests/benchmarks/: "benchmarks" plays the package whose frames are attributed
PACKAGE = "benchmarks"


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _outer(seconds: float) -> None:
    _spin(seconds)


def test_classify_names_outermost_and_innermost_package_frames():
    seen = {}

    def probe():
        seen["where"] = ss.classify(sys._getframe(), PACKAGE)

    def middle():
        probe()
    middle()
    entry, leaf, inner = seen["where"]
    assert leaf == inner == "benchmarks/test_stack_sampler.py:probe"
    # the outermost frame of this file on the stack is the test function itself
    assert entry == "benchmarks/test_stack_sampler.py:test_classify_names_outermost_and_innermost_package_frames"
    assert ss.classify(None, PACKAGE) == ("-", "-", "-")


def test_sampler_attributes_a_busy_thread_to_its_function():
    worker = threading.Thread(target=_outer, args=(0.6,), name="busy-worker")
    with ss.StackSampler(interval=0.001, package=PACKAGE) as sampler:
        worker.start()
        worker.join()
    assert sampler.samples > 20
    entries = sampler.entries["busy-worker"]
    leaves = sampler.leaves["busy-worker"]
    # nearly all of its samples are in _spin, entered through _outer
    assert entries["benchmarks/test_stack_sampler.py:_outer"] >= 0.8 * sum(entries.values())
    assert leaves["benchmarks/test_stack_sampler.py:_spin"] >= 0.8 * sum(leaves.values())
    text = sampler.summary()
    assert "[busy-worker]" in text and "_spin" in text
    assert "stack-sampler" not in text  # the sampler does not sample itself

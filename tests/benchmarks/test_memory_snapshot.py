"""benchmarks/memory_snapshot.py: the replay of an allocation log finds the blocks that are
live at the peak and names the line of our code that allocated each."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import memory_snapshot as ms  # noqa: E402

MIB = 1024**2


def _frames(*where: str) -> list:
    return [{"filename": f, "line": n, "name": fn} for f, n, fn in
            (w.split(":") for w in where)]


OURS = _frames("/x/torch/nn/modules/linear.py:10:forward",
               "/x/site-packages/shardwise/zero/flat_buckets.py:112:build_bucket")
HF = _frames("/x/torch/nn/functional.py:5:silu", "/x/transformers/models/llama/x.py:7:mlp")


def test_peak_live_set_excludes_blocks_freed_before_and_allocated_after_it() -> None:
    trace = [
        {"action": "alloc", "addr": 1, "size": 100 * MIB, "frames": OURS},
        {"action": "alloc", "addr": 2, "size": 50 * MIB, "frames": HF},
        {"action": "free_requested", "addr": 2, "size": 50 * MIB},
        {"action": "free_completed", "addr": 2, "size": 50 * MIB},
        {"action": "alloc", "addr": 3, "size": 70 * MIB, "frames": HF},   # peak: 170 MiB
        {"action": "free_completed", "addr": 3, "size": 70 * MIB},
        {"action": "alloc", "addr": 4, "size": 60 * MIB, "frames": HF},   # 160: below the peak
        {"action": "free_completed", "addr": 99, "size": 5},              # unseen block: ignored
    ]
    peak, at, live = ms.live_at_peak(trace)
    assert peak == 170 * MIB and at == 4
    assert [b.size for b in live] == [100 * MIB, 70 * MIB]


def test_owner_is_the_innermost_frame_of_our_code_with_a_short_path() -> None:
    assert ms.owner(OURS) == "shardwise/zero/flat_buckets.py:112 build_bucket"
    assert ms.owner(HF) == "transformers/models/llama/x.py:7 mlp"
    assert ms.owner(_frames("/x/torch/a.py:1:f")) == "/x/torch/a.py:1 f"
    assert ms.owner([]) == "<no stack>"


def test_summary_ranks_owners_by_live_bytes() -> None:
    trace = [{"action": "alloc", "addr": i, "size": (i + 1) * MIB, "frames": OURS if i % 2 else HF}
             for i in range(6)]
    text = ms.summarize(trace, top=1)
    body = text.splitlines()
    ours = next(line for line in body if "build_bucket" in line and line.split()[0][0].isdigit())
    assert ours.split()[1] == "3"                      # blocks 1, 3, 5
    assert abs(float(ours.split()[0]) - 12 / 1024) < 1e-3
    assert "(1 other places)" in text                  # the HF group, beyond top=1

"""How fast the offloaded optimizer step runs on this host, and what slows it down.

ZeRO-Offload's CPU step (torch's fused CPU AdamW over fp32 masters, gradients and the two
moment buffers: about 28 bytes of host memory traffic per parameter) decides how long the
boundary of an offloaded step lasts. In training it runs on a worker thread, bucket by
bucket, while the GPU's threads launch kernels and the copy engines move gradients and
weights through the same host memory. This times that step alone, under each of those
conditions, on buckets of the size the engine uses:

    python benchmarks/offload_step_bench.py                 # on the GPU machine
    python benchmarks/offload_step_bench.py --params-m 200  # smaller, e.g. on a CPU machine

Each row is one full pass over ``--params-m`` million parameters (median of ``--repeats``
passes after one untimed pass that creates the optimizer state), in G params/s; the table's
last column is the ratio to the first row.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from shardwise.offload.cpu_worker import THREADS_ENV, cpu_step_pool  # noqa: E402


def make_buckets(total: int, bucket: int, pin: bool) -> List[List[torch.Tensor]]:
    """fp32 master pieces (with .grad) grouped into buckets; each bucket's pieces are views of
    one flat buffer, split like a decoder layer's weights (sizes vary, as in training)."""
    shares = [0.09, 0.01, 0.01, 0.09, 0.26, 0.26, 0.28]  # q k v o gate up down of a Llama layer
    out = []
    for lo in range(0, total, bucket):
        n = min(bucket, total - lo)
        flat = torch.randn(n, dtype=torch.float32)
        grad = torch.randn(n, dtype=torch.float32) * 1e-3
        if pin:
            flat, grad = flat.pin_memory(), grad.pin_memory()
        pieces, off = [], 0
        for i, share in enumerate(shares):
            size = n - off if i == len(shares) - 1 else int(n * share)
            p = flat[off:off + size]
            p.grad = grad[off:off + size]
            pieces.append(p)
            off += size
        out.append(pieces)
    return out


def one_pass(opt: torch.optim.Optimizer, buckets: List[List[torch.Tensor]],
             run: Callable[[Callable[[], None]], None]) -> float:
    """Step every bucket once (each with only its own pieces holding gradients, as the
    engine's eager step does); returns seconds."""
    grads = [[p.grad for p in b] for b in buckets]
    for b in buckets:
        for p in b:
            p.grad = None
    t0 = time.perf_counter()
    for b, g in zip(buckets, grads):
        def step(b=b, g=g) -> None:
            for p, gp in zip(b, g):
                p.grad = gp
            opt.step()
            for p in b:
                p.grad = None
        run(step)
    seconds = time.perf_counter() - t0
    for b, g in zip(buckets, grads):
        for p, gp in zip(b, g):
            p.grad = gp
    return seconds


class CopyLoad:
    """Keeps both copy directions busy with pinned host <-> device copies (what gradient
    round trips and weight uploads do during an offloaded boundary)."""

    def __init__(self, chunk_mb: int = 256) -> None:
        n = chunk_mb * 2**20 // 4
        self.host = [torch.empty(n, dtype=torch.float32).pin_memory() for _ in range(2)]
        self.dev = [torch.empty(n, dtype=torch.float32, device="cuda") for _ in range(2)]
        self.streams = [torch.cuda.Stream() for _ in range(2)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            with torch.cuda.stream(self.streams[0]):
                self.dev[0].copy_(self.host[0], non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.host[1].copy_(self.dev[1], non_blocking=True)
            self.streams[0].synchronize()
            self.streams[1].synchronize()

    def __enter__(self) -> "CopyLoad":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def measure(name: str, buckets, threads: int, worker: bool, repeats: int,
            load: Optional[Callable[[], object]] = None) -> dict:
    opt = torch.optim.AdamW([p for b in buckets for p in b], lr=1e-4, fused=True)
    pool = None
    if worker:  # the engine's own worker, with its thread count set as a user would
        saved_env = os.environ.get(THREADS_ENV)
        os.environ[THREADS_ENV] = str(threads)
        pool = cpu_step_pool("offload-step-bench")
        if saved_env is None:
            del os.environ[THREADS_ENV]
        else:
            os.environ[THREADS_ENV] = saved_env
    saved = torch.get_num_threads()
    if not worker:
        torch.set_num_threads(threads)

    def run(step):
        if pool is None:
            step()
        else:
            pool.submit(step).result()
    one_pass(opt, buckets, run)  # lazy state
    ctx = load() if load is not None else None
    if ctx is not None:
        ctx.__enter__()
    try:
        times = [one_pass(opt, buckets, run) for _ in range(repeats)]
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if pool is not None:
            pool.shutdown()
        torch.set_num_threads(saved)
    n = sum(p.numel() for b in buckets for p in b)
    sec = statistics.median(times)
    return {"name": name, "seconds": sec, "gparams_s": n / sec / 1e9}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=int, default=550, help="million parameters per pass")
    ap.add_argument("--bucket-m", type=int, default=50, help="million parameters per bucket")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="", help="comma-separated counts (default: all, "
                    "all-1, all-2, 3/4, 1/2 of torch's)")
    args = ap.parse_args(argv)
    total, bucket = args.params_m * 10**6, args.bucket_m * 10**6
    full = torch.get_num_threads()
    counts = ([int(t) for t in args.threads.split(",") if t] if args.threads else
              sorted({full, max(1, full - 1), max(1, full - 2), max(1, full * 3 // 4),
                      max(1, full // 2)}, reverse=True))
    cuda = torch.cuda.is_available()
    pinned = make_buckets(total, bucket, pin=cuda)
    rows = [measure(f"worker, {full} threads{', pinned' if cuda else ''}", pinned, full, True,
                    args.repeats),
            measure(f"main thread, {full} threads", pinned, full, False, args.repeats)]
    for t in counts:
        if t != full:
            rows.append(measure(f"worker, {t} threads", pinned, t, True, args.repeats))
    if cuda:
        unpinned = make_buckets(total, bucket, pin=False)
        rows.append(measure(f"worker, {full} threads, unpinned", unpinned, full, True,
                            args.repeats))
        del unpinned
        for t in counts:
            rows.append(measure(f"worker, {t} threads, copies running", pinned, t, True,
                                args.repeats, load=CopyLoad))
    base = rows[0]["gparams_s"]
    print(f"{'case':<44}{'s/pass':>9}{'Gparams/s':>11}{'x first':>9}")
    for r in rows:
        print(f"{r['name']:<44}{r['seconds']:9.3f}{r['gparams_s']:11.2f}"
              f"{r['gparams_s'] / base:9.2f}")


if __name__ == "__main__":
    main()

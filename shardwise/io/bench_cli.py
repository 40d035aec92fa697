"""``shardwise io-bench`` and ``shardwise nvme-tune``: the disk's speed through the IO layer.

``io-bench`` measures write and read GB/s through :class:`~shardwise.io.aio_handle.AsyncIOHandle`
next to a dd-style sequential baseline in the same run; DeepSpeed's ``ds_io`` flags are
accepted as aliases. ``nvme-tune`` sweeps block size, queue depth and threads and prints the
best ``aio`` section (the keys shardwise's config reads) as JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..config.aio import aio_section
from .aligned import ALIGN
from .bench import BenchConfig, BenchResult, measure, parse_size


def _common(parser: argparse.ArgumentParser, size_default: str) -> None:
    parser.add_argument("--path", "--folder", dest="path", required=True,
                        help="folder on the disk to measure (a test file is written there and "
                             "removed when done); ds_io's --folder")
    parser.add_argument("--size", "--io_size", dest="size", default=size_default,
                        help=f"bytes per pass, with K/M/G suffixes (binary; default {size_default}); "
                             "rounded up to a multiple of 4 KiB")
    io = parser.add_mutually_exclusive_group()
    io.add_argument("--direct", dest="direct", action="store_true", default=True,
                    help="O_DIRECT where the filesystem allows it (default)")
    io.add_argument("--buffered", dest="direct", action="store_false",
                    help="through the page cache (writes fsync'd, cache dropped before reads)")
    parser.add_argument("--gds", "--use_gds", dest="gds", action="store_true",
                        help="GPUDirect Storage through kvikio (needs CUDA and kvikio)")
    parser.add_argument("--gpu", action="store_true",
                        help="move the data to/from a CUDA tensor (through pinned host memory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def build_bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise io-bench",
        description="Write/read GB/s through shardwise's IO layer next to a dd-style baseline "
                    "(DeepSpeed's ds_io flags are accepted).")
    _common(parser, "1G")
    parser.add_argument("--block-size", "--block_size", dest="block_size", default="1M",
                        help="bytes per request block (default 1M)")
    parser.add_argument("--queue-depth", "--queue_depth", dest="queue_depth", type=int, default=8,
                        help="blocks in flight per thread unit (default 8)")
    parser.add_argument("--threads", "--io_parallel", dest="threads", type=int, default=4,
                        help="intra_op_parallelism (default 4); IO threads = threads x queue depth")
    rw = parser.add_mutually_exclusive_group()
    rw.add_argument("--read", action="store_true", help="measure reads only (ds_io: --read)")
    rw.add_argument("--write", action="store_true", help="measure writes only")
    parser.add_argument("--loops", type=int, default=1, help="repetitions, averaged (default 1)")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="skip the dd-style baseline")
    return parser


def _aligned_size(text: str, flag: str) -> int:
    size = parse_size(text, flag)
    return size + (-size % ALIGN)


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _print_result(res: BenchResult) -> None:
    print(f"io-bench {res.path}: {res.size_bytes / 2**20:.0f} MiB, block {res.block_size}, "
          f"queue depth {res.queue_depth}, threads {res.threads} ({res.io_threads} IO threads), "
          f"{'O_DIRECT' if res.direct else 'buffered'}{', gds' if res.gds else ''}, "
          f"{res.loops} loop(s), data verified: {res.verified}")
    print(f"{'':10}{'shardwise GB/s':>16}{'dd-style GB/s':>16}{'ratio':>8}")
    d = res.as_dict()
    for kind in ("write", "read"):
        ratio = d[f"{kind}_vs_baseline"]
        print(f"{kind:10}{_fmt(d[f'{kind}_gbps']):>16}{_fmt(d[f'baseline_{kind}_gbps']):>16}"
              f"{_fmt(ratio):>8}")


def io_bench_main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_bench_parser().parse_args(argv)
    cfg = BenchConfig(folder=Path(args.path), size=_aligned_size(args.size, "--size"),
                      block_size=parse_size(args.block_size, "--block-size"),
                      queue_depth=args.queue_depth, threads=args.threads, direct=args.direct,
                      gds=args.gds, gpu=args.gpu, loops=max(1, args.loops),
                      read=not args.write, write=not args.read, baseline=args.baseline)
    res = measure(cfg)
    if args.json:
        print(json.dumps(res.as_dict()))
    else:
        _print_result(res)
    return 0


# --------------------------------------------------------------------------- nvme-tune


def build_tune_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise nvme-tune",
        description="Sweep aio block size, queue depth and threads on a disk; print a table and "
                    "the best \"aio\" config section (DeepSpeed's ds_nvme_tune).")
    _common(parser, "256M")
    parser.add_argument("--block-sizes", default="256K,1M,4M",
                        help="comma-separated block sizes to try (default 256K,1M,4M)")
    parser.add_argument("--queue-depths", default="4,8,16",
                        help="comma-separated queue depths to try (default 4,8,16)")
    parser.add_argument("--threads", default="1,2,4",
                        help="comma-separated intra_op_parallelism values to try (default 1,2,4)")
    return parser


def _int_list(text: str, flag: str, sizes: bool = False) -> List[int]:
    try:
        values = [parse_size(v, flag) if sizes else int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        from ..errors import StorageError
        raise StorageError(f"{flag} {text!r}: expected comma-separated positive values.")
    return values


def effective_gbps(read: float, write: float) -> float:
    """GB/s of moving the same bytes out and back in (a swap): 2 / (1/read + 1/write)."""
    return 2.0 / (1.0 / max(read, 1e-9) + 1.0 / max(write, 1e-9))


def sweep(base: BenchConfig, grid: List[Tuple[int, int, int]]) -> List[Dict[str, object]]:
    """Measure each (block size, queue depth, threads) of ``grid``; rows sorted best first."""
    from tqdm import tqdm
    rows = []
    for block, depth, threads in tqdm(grid, desc="nvme-tune", disable=None, file=sys.stderr):
        cfg = BenchConfig(folder=base.folder, size=base.size, block_size=block, queue_depth=depth,
                          threads=threads, direct=base.direct, gds=base.gds, gpu=base.gpu,
                          baseline=False)
        res = measure(cfg)
        rows.append({"block_size": block, "queue_depth": depth, "intra_op_parallelism": threads,
                     "read_gbps": res.read_gbps, "write_gbps": res.write_gbps,
                     "effective_gbps": round(effective_gbps(res.read_gbps or 0, res.write_gbps or 0), 3),
                     "direct": res.direct})
    return sorted(rows, key=lambda r: -float(r["effective_gbps"]))  # type: ignore[arg-type]


def nvme_tune_main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_tune_parser().parse_args(argv)
    blocks = _int_list(args.block_sizes, "--block-sizes", sizes=True)
    depths = _int_list(args.queue_depths, "--queue-depths")
    threads = _int_list(args.threads, "--threads")
    base = BenchConfig(folder=Path(args.path), size=_aligned_size(args.size, "--size"),
                       direct=args.direct, gds=args.gds, gpu=args.gpu)
    rows = sweep(base, list(itertools.product(blocks, depths, threads)))
    best = rows[0]
    section = aio_section(int(best["block_size"]), int(best["queue_depth"]),  # type: ignore[arg-type]
                          int(best["intra_op_parallelism"]), use_gds=args.gds)  # type: ignore[arg-type]
    if args.json:
        print(json.dumps({"aio": section, "results": rows}))
        return 0
    print(f"{'block_size':>11}{'queue_depth':>12}{'threads':>8}{'write GB/s':>11}{'read GB/s':>10}"
          f"{'effective':>10}")
    for r in rows:
        print(f"{r['block_size']:>11}{r['queue_depth']:>12}{r['intra_op_parallelism']:>8}"
              f"{_fmt(r['write_gbps']):>11}{_fmt(r['read_gbps']):>10}{_fmt(r['effective_gbps']):>10}")  # type: ignore[arg-type]
    print("\nbest (effective = 2 / (1/read + 1/write), a swap's out-and-back speed); paste into "
          "your config:")
    print(json.dumps({"aio": section}, indent=2))
    return 0

"""The flat collectives at world sizes 2 and 4: native calls and the gloo fallbacks
(all-reduce + slice for reduce-scatter, all-gather into views) give the same results."""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed


def _collectives(rank: int, world: int):
    from shardwise import comm
    out = {}
    for fallback in ("0", "1"):
        os.environ["SHARDWISE_COMM_FALLBACK"] = fallback
        n = 3
        full = torch.arange(world * n, dtype=torch.float32) + 100 * rank
        mine = torch.empty(n)
        comm.reduce_scatter_flat(mine, full.clone(), async_op=True).wait()
        gathered = torch.empty(world * n)
        work = comm.all_gather_flat(gathered, torch.full((n,), float(rank)), async_op=True)
        work.wait()
        # in place, as the ZeRO strategies use it: the input is this rank's slice of the output
        inplace = torch.zeros(world * n)
        inplace[rank * n:(rank + 1) * n] = rank + 1
        comm.all_gather_flat(inplace, inplace[rank * n:(rank + 1) * n])
        out[fallback] = (mine, gathered, inplace)
    return {"rank": comm.get_rank(), "world": comm.get_world_size(), "results": out}


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_and_all_gather_native_and_fallback(world: int) -> None:
    n = 3
    for rank, res in enumerate(run_distributed(_collectives, world)):
        assert (res["rank"], res["world"]) == (rank, world)
        want_rs = sum(torch.arange(world * n, dtype=torch.float32) + 100 * r
                      for r in range(world))[rank * n:(rank + 1) * n]
        want_ag = torch.arange(world).repeat_interleave(n).float()
        for fallback, (mine, gathered, inplace) in res["results"].items():
            assert torch.equal(mine, want_rs), fallback
            assert torch.equal(gathered, want_ag), fallback
            assert torch.equal(inplace, want_ag + 1), fallback

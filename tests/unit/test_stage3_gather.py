"""zero/stage3 partition + gather: a record's RELEASED -> INFLIGHT -> GATHERED -> RELEASED
states, the live set of each gather context, ownership moving between partitioners; and the
host gradient accumulator of offload/host_grads.py (overwrite, add, norms, ordering)."""
from __future__ import annotations

import torch

from shardwise.offload.host_grads import HostGradAccumulator
from shardwise.offload.step_subset import HiddenGrads, step_subset
from shardwise.zero.stage3.partition import (GATHERED, INFLIGHT, RELEASED, Partitioner,
                                             full_shape, owner_of, record_of)
from shardwise.zero.stage3.storage import ShardStorage, TensorShard

CPU = torch.device("cpu")


def _partitioner() -> Partitioner:
    return Partitioner(group=None, shard_device=CPU, compute_device=CPU)


def test_partition_keeps_a_typed_record_and_nothing_on_the_parameter() -> None:
    p = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))
    before = set(vars(p))
    part = _partitioner()
    rec = part.partition(p)
    assert set(vars(p)) == before, "no attributes stuck on the parameter"
    assert p.numel() == 0 and full_shape(p) == torch.Size([3, 4]) and rec.numel == 12
    assert isinstance(rec.storage, ShardStorage) and isinstance(rec.storage, TensorShard)
    assert record_of(p) is rec and owner_of(p) is part and rec.status == RELEASED
    assert torch.equal(rec.shard, torch.arange(12.0))


def test_gather_release_states_and_live_set() -> None:
    p = torch.nn.Parameter(torch.randn(5, 3))
    want = p.detach().clone()
    part = _partitioner()
    rec = part.partition(p)
    gathers = part.gathers
    gathers.start([rec])
    assert rec.status == INFLIGHT and gathers.live_numel == 15 and id(rec) in gathers.live
    gathers.wait(rec)
    assert rec.status == GATHERED and torch.equal(p.data, want)
    saved = p.data  # what autograd would have saved for backward
    gathers.release(rec)
    assert rec.status == RELEASED and p.numel() == 0 and gathers.live_numel == 0
    assert saved.untyped_storage().size() == 0, "a release frees the full buffer's memory"
    gathers.gather([rec])
    assert torch.equal(saved, want), "a later gather refills the storage saved views see"
    # sweep: active records and kept ones stay; the rest goes
    q = torch.nn.Parameter(torch.randn(4))
    rq = part.partition(q)
    gathers.gather([rq])
    rec.active = 1
    gathers.sweep()
    assert rec.status == GATHERED and rq.status == RELEASED
    rec.active = 0
    gathers.sweep(keep={id(rec)})
    assert rec.status == GATHERED
    gathers.sweep()
    assert rec.status == RELEASED and not gathers.live


def test_gather_contexts_are_independent_and_adopt_moves_ownership() -> None:
    a, b = _partitioner(), _partitioner()
    pa, pb = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(6))
    ra, rb = a.partition(pa), b.partition(pb)
    a.gathers.gather([ra])
    b.gathers.gather([rb])
    b.gathers.sweep()
    assert ra.status == GATHERED and rb.status == RELEASED, "a sweep touches its own engine only"
    a.gathers.sweep()
    value = ra.shard.clone()
    moved = b.partition(pa)  # an engine adopting a zero.Init-built parameter
    assert moved is ra and owner_of(pa) is b and a.record(pa) is None
    assert torch.equal(moved.shard, value)
    b.unpartition(pa)
    assert record_of(pa) is None and owner_of(pa) is None and torch.equal(pa.data, value)


def test_host_grad_accumulator_overwrites_adds_and_measures() -> None:
    acc = HostGradAccumulator(CPU, CPU)  # host partitions: the worker does the arithmetic
    dst = torch.full((4,), 7.0)
    order = []
    acc.reset_sumsq()
    acc.add_into(dst, torch.ones(4), overwrite=True)  # the window's first gradient
    acc.add_into(dst, torch.full((4,), 2.0), overwrite=False, final=True,
                 after=lambda: order.append(dst.clone()))
    acc.wait()
    assert torch.equal(dst, torch.full((4,), 3.0))
    assert torch.equal(order[0], dst), "after() runs once the result is in place"
    assert float(acc.sumsq()) == 36.0
    acc.close()


def test_step_subset_shows_the_optimizer_only_its_subset() -> None:
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    b.grad = torch.ones(2)
    opt = torch.optim.SGD([a, b], lr=1.0)
    step_subset(opt.step, [(a, torch.ones(2))], hide=[b])
    assert torch.equal(a.detach(), -torch.ones(2)) and torch.equal(b.detach(), torch.zeros(2))
    assert a.grad is None and torch.equal(b.grad, torch.ones(2))
    hidden = HiddenGrads()
    hidden.hide([b])
    assert b.grad is None and hidden
    hidden.restore()
    assert torch.equal(b.grad, torch.ones(2)) and not hidden

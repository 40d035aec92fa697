"""The offloaded step's timing (offload/step_schedule.py) and stage 3's host masters
(offload/host_pieces.py), on their own: what the ZeRO strategies rely on."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from shardwise.offload.host_pieces import HostPieces
from shardwise.offload.step_schedule import StepSchedule


def test_the_delayed_update_starts_after_its_warmup() -> None:
    schedule = StepSchedule(delayed=True, warmup=2, name="t")
    kinds = [schedule.begin_step() for _ in range(4)]
    assert kinds == [False, False, True, True]
    assert schedule.steps_done == 4 and schedule.delayed_now
    schedule.close()
    plain = StepSchedule(delayed=False, warmup=0, name="t", worker=False)
    assert [plain.begin_step() for _ in range(3)] == [False] * 3 and plain.pool is None
    plain.close()


def test_eager_steps_come_back_in_order_and_the_delayed_one_is_waited_for() -> None:
    schedule = StepSchedule(delayed=True, warmup=0, name="t")
    gate, ran = threading.Event(), []
    schedule.submit_eager("b0", lambda: (gate.wait(5), ran.append("b0")))
    schedule.submit_eager("b1", ran.append, "b1")
    assert schedule.busy
    gate.set()
    assert list(schedule.finish_eager()) == ["b0", "b1"] and ran == ["b0", "b1"]
    assert not schedule.busy and not schedule.finish_delayed()
    schedule.submit_delayed(ran.append, "dpu")
    assert schedule.pending is not None and schedule.busy
    assert schedule.finish_delayed() and ran[-1] == "dpu"
    assert schedule.pending is None and not schedule.wait()
    schedule.close()


def test_an_error_on_the_worker_reaches_the_step() -> None:
    schedule = StepSchedule(delayed=True, warmup=0, name="t")
    schedule.submit_delayed(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        schedule.wait()
    assert schedule.pending is None
    schedule.close()


def test_host_pieces_view_the_owned_elements_and_swap_gradient_sets() -> None:
    shards = [torch.arange(6.0), torch.arange(4.0) + 10, torch.zeros(3)]
    recs = [SimpleNamespace(own_len=n, shard=s) for n, s in zip((4, 0, 3), shards)]
    pieces = HostPieces([[(1, recs[0]), (2, recs[1])], [(3, recs[2])]],
                        device=torch.device("cpu"), pin=False, double_grads=True)
    assert sorted(pieces.piece) == [1, 3]  # a parameter owning nothing has no piece
    assert torch.equal(pieces.piece[1], torch.arange(4.0))
    assert pieces.piece[1].data_ptr() == pieces.flat_master[0].data_ptr()
    assert pieces.spare_bytes() == (4 + 3) * 4
    first = pieces.grad_of[1]
    pieces.grad_of[1].fill_(2.0)
    pieces.scale_grads(torch.tensor(0.5))
    assert torch.all(first == 1.0)
    pieces.swap_grads()
    assert pieces.grad_of[1].data_ptr() != first.data_ptr()
    assert pieces.spare_grad_of[1] is first
    pieces.attach_grads(True)
    assert pieces.piece[1].grad is pieces.grad_of[1]
    pieces.attach_grads(False)
    assert pieces.piece[3].grad is None
    pieces.swap_grads()
    assert pieces.grad_of[1] is first and [g.numel() for g in pieces.grads()] == [4, 3]

"""shardwise/offload/cpu_worker.py: the offload worker's intra-op thread count."""
from __future__ import annotations

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.offload.cpu_worker import THREADS_ENV, cpu_step_pool, offload_threads


@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def _worker_threads() -> int:
    pool = cpu_step_pool("test")
    try:
        return pool.submit(torch.get_num_threads).result()
    finally:
        pool.shutdown()


def test_worker_uses_torchs_count_unless_the_environment_sets_one(four_threads, monkeypatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert offload_threads() is None and _worker_threads() == 4
    monkeypatch.setenv(THREADS_ENV, "3")
    assert _worker_threads() == 3
    assert torch.get_num_threads() == 4  # the calling thread keeps its own count


@pytest.mark.parametrize("bad", ["0", "many", "-2"])
def test_bad_thread_counts_say_what_to_do(four_threads, monkeypatch, bad) -> None:
    monkeypatch.setenv(THREADS_ENV, bad)
    with pytest.raises(ConfigError, match=f"{THREADS_ENV}='{bad}'.*unset it to use torch's 4"):
        offload_threads()

"""The ``aio`` section: DeepSpeed's keys and defaults, the old thread_count name, bad values."""
from __future__ import annotations

import pytest

from shardwise.config import load_config
from shardwise.config.aio import AioConfig, aio_section
from shardwise.config.platform_keys import platform_key_notes
from shardwise.errors import ConfigError


def _cfg(aio):
    return load_config({"train_batch_size": 8, "aio": aio}, world_size=1)


def test_defaults_are_deepspeeds():
    aio = load_config({"train_batch_size": 8}, world_size=1).aio
    assert (aio.block_size, aio.queue_depth, aio.intra_op_parallelism, aio.single_submit,
            aio.overlap_events, aio.use_gds) == (1048576, 8, 1, False, True, False)
    assert aio.handle_kwargs() == {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                                   "overlap_events": True, "intra_op_parallelism": 1,
                                   "use_gds": False}


@pytest.mark.parametrize("given", [{"thread_count": 4}, {"intra_op_parallelism": 4},
                                   {"thread_count": 4, "intra_op_parallelism": 4}])
def test_thread_count_is_the_old_name_of_intra_op_parallelism(given):
    aio = _cfg(given).aio
    assert aio.intra_op_parallelism == 4 and aio.thread_count == 4


def test_disagreeing_names_are_an_error():
    with pytest.raises(ConfigError, match=r"aio.intra_op_parallelism = 2 and aio.thread_count = 4 disagree"):
        _cfg({"intra_op_parallelism": 2, "thread_count": 4})


@pytest.mark.parametrize("key,value,rule", [
    ("block_size", 0, "positive integer"), ("block_size", -4096, "positive integer"),
    ("block_size", 1000, "multiple of 512"), ("queue_depth", 0, "positive integer"),
    ("intra_op_parallelism", -1, "positive integer"), ("thread_count", True, "positive integer"),
    ("queue_depth", "8", "positive integer")])
def test_bad_values_name_the_key(key, value, rule):
    with pytest.raises(ConfigError, match=rf"aio\.{key} = .*{rule}"):
        _cfg({key: value})


def test_windows_io_optimization_says_what_happens_on_each_platform():
    cfg = _cfg({"windows_io_optimization": True})
    # off Windows the seed's Windows keys are named in one info line (issue 18), no warning
    linux = platform_key_notes(cfg, "Linux")
    assert len(linux) == 1 and "aio.windows_io_optimization" in linux[0] and "no effect" in linux[0]
    windows = [n for n in platform_key_notes(cfg, "Windows") if n.startswith("aio.windows_io_optimization")]
    assert len(windows) == 1
    assert "no effect" in windows[0] and "one file handle per IO thread" in windows[0]
    assert "nvme-tune" in windows[0]


def test_aio_section_round_trips_through_the_config():
    section = aio_section(262144, 16, 4)
    assert set(section) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                            "overlap_events", "use_gds"}
    assert AioConfig(**section).handle_kwargs()["intra_op_parallelism"] == 4
    assert _cfg(section).aio.queue_depth == 16

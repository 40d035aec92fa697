"""The comms logger in one process: DeepSpeed's bandwidth formulas and sizes, the summary
table, prof_all / prof_ops / debug / verbose, and nothing recorded while disabled."""
from __future__ import annotations

import pytest
import torch

from shardwise import comm
from shardwise.comm.comms_logger import CommsLogger, calc_bw_log, convert_size, trim_mean


@pytest.fixture
def world_of_one():
    comm.init_distributed()
    comm.reset_log()
    yield
    comm.configure(enabled=False, verbose=False, prof_all=True, prof_ops=[], debug=False)
    comm.reset_log()


def test_bandwidth_formulas_per_op() -> None:
    # 1 MB in 1 ms = 8 Gbps of message; world of 4
    mb, n = 10**6, 4
    assert calc_bw_log("all_reduce", mb, 1.0, n) == pytest.approx((16.0, 8.0 * 2 * 3 / 4))
    assert calc_bw_log("all_gather_into_tensor", mb, 1.0, n) == pytest.approx((32.0, 32.0 * 3 / 4))
    assert calc_bw_log("reduce_scatter_tensor", mb, 1.0, n) == pytest.approx((8.0, 8.0 * 3 / 4))
    assert calc_bw_log("broadcast", mb, 1.0, n) == pytest.approx((8.0, 8.0))
    assert calc_bw_log("barrier", 0, 1.0, n) == (0.0, 0.0)
    assert convert_size(0) == "0B" and convert_size(1536) == "1.5 KB"
    assert convert_size(40) == "40.0 B" and convert_size(3 * 1024**3) == "3.0 GB"
    assert trim_mean([1, 2, 3, 4, 100, 5, 6, 7, 8, 9]) == pytest.approx(5.5)


def test_records_direct_calls_and_prints_deepspeeds_table(world_of_one, capsys) -> None:
    t = torch.ones(10)
    comm.all_reduce(t)
    assert not comm.has_comm_data()  # disabled: nothing recorded
    comm.configure(enabled=True)
    comm.all_reduce(t)
    comm.all_reduce(t)
    comm.broadcast(torch.ones(4, dtype=torch.float16), src=0)
    out = torch.empty(10)
    comm.all_gather_into_tensor(out, t)
    got = comm.log_summary(return_dict=True)
    summary = got["summary"]
    assert {k: {s: r["count"] for s, r in v.items()} for k, v in summary.items()} == {
        "all_reduce": {40: 2}, "broadcast": {8: 1}, "all_gather_into_tensor": {40: 1}}
    rec = summary["all_reduce"][40]
    assert rec["total_latency_ms"] > 0 and rec["msg_size_str"] == "40.0 B"
    assert got["metadata"]["world_size"] == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["Comm.", "Op", "Message", "Size", "Count", "Total",
                                  "Latency(ms)", "Avg", "Latency(ms)", "tput_avg", "(Gbps)",
                                  "busbw_avg", "(Gbps)"]
    assert printed[1] == "all_reduce" and printed[2].split()[:3] == ["40.0", "B", "2"]
    comm.reset_log()
    assert not comm.has_comm_data()


def test_prof_ops_debug_and_verbose(world_of_one, caplog) -> None:
    comm.configure(enabled=True, prof_all=False, prof_ops=["broadcast"], debug=True, verbose=True)
    t = torch.ones(3)
    comm.all_reduce(t)
    comm.broadcast(t, src=0)
    comm.all_reduce(t, prof=True)  # DeepSpeed's per-call switch
    names = set(comm.comms_logger.comms_dict)
    assert names == {"broadcast | [Caller Func: test_prof_ops_debug_and_verbose]",
                     "all_reduce | [Caller Func: test_prof_ops_debug_and_verbose]"}
    assert comm.comms_logger.comms_dict[
        "all_reduce | [Caller Func: test_prof_ops_debug_and_verbose]"][12].count == 1


def test_config_section_configures_the_logger(world_of_one) -> None:
    import shardwise
    from tests.distributed._parity import engine_config, make_model
    cfg = engine_config(stage=0, micro=2, ga=1, clip=0.0, lr=1e-2,
                        comms_logger={"enabled": True, "prof_all": False, "prof_ops": ["x"]})
    shardwise.initialize(model=make_model(), config=cfg)
    logger = comm.comms_logger
    assert (logger.enabled, logger.prof_all, logger.prof_ops) == (True, False, ["x"])


def test_a_fresh_logger_is_off() -> None:
    logger = CommsLogger()
    calls = []
    assert logger.run("all_reduce", 4, lambda: calls.append(1)) is None and calls == [1]
    assert not logger.has_data()

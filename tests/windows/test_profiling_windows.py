"""The flops profiler's report file and the comms logger on the platform the tests run on
(a real Windows CPython under the Windows job): the report goes to a new folder whose name
has spaces, and a world of one (gloo, in-memory store) records a collective."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.windows


def test_profile_report_written_to_a_new_folder_with_spaces(tmp_path: Path) -> None:
    from shardwise.profiling.flops_profiler import get_model_profile
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    out = tmp_path / "My Runs" / "flops profile" / "report.txt"
    flops, macs, params = get_model_profile(model, input_shape=(2, 8), output_file=str(out),
                                            as_string=False)
    assert (macs, params) == (2 * 8 * 16 + 2 * 16 * 4, 8 * 16 + 16 + 16 * 4 + 4)
    text = out.read_text(encoding="utf-8")
    assert "params per GPU:" in text and "Detailed Profile per GPU" in text


def test_comms_logger_records_in_a_world_of_one() -> None:
    from shardwise import comm
    comm.init_distributed()
    comm.reset_log()
    comm.configure(enabled=True)
    try:
        comm.all_reduce(torch.ones(5))
        summary = comm.log_summary(return_dict=True)["summary"]
    finally:
        comm.configure(enabled=False)
        comm.reset_log()
    assert summary["all_reduce"][20]["count"] == 1

"""Hostfile parsing and DeepSpeed's include/exclude/num_nodes/num_gpus filters."""
import pytest

from shardwise.errors import LaunchError
from shardwise.launcher.hostfile import (expand_slots, filter_resources, limit_resources,
                                         parse_filter, parse_hostfile, read_hostfile)

FOUR = expand_slots({"worker-0": 4, "worker-1": 4, "worker-2": 4, "worker-3": 4})


def test_parse_hostfile_keeps_order_and_ignores_comments():
    text = "# cluster\n\nworker-1 slots=2\n  worker-0   slots = 8  # big one\nlocalhost slots=1\n"
    hosts = parse_hostfile(text)
    assert list(hosts.items()) == [("worker-1", 2), ("worker-0", 8), ("localhost", 1)]


@pytest.mark.parametrize("text, fragment", [
    ("worker-0\n", "line 1"),
    ("worker-0 slots=4\nworker-1 slots=x\n", "line 2"),
    ("worker-0 gpus=4\n", "HOST slots=N"),
    ("worker-0 slots=0\n", "at least 1"),
    ("worker-0 slots=2\nworker-0 slots=2\n", "listed twice"),
    ("# only comments\n\n", "names no hosts"),
])
def test_parse_hostfile_rejects_bad_lines(text, fragment):
    with pytest.raises(LaunchError, match=fragment):
        parse_hostfile(text)


def test_read_hostfile_missing(tmp_path):
    assert read_hostfile(str(tmp_path / "nope"), required=False) is None
    with pytest.raises(LaunchError, match="does not exist"):
        read_hostfile(str(tmp_path / "nope"), required=True)
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots=3\n")
    assert read_hostfile(str(path), required=True) == {"a": 2, "b": 3}


@pytest.mark.parametrize("spec, expected", [
    ("worker-0", {"worker-0": None}),
    ("worker-1:0,2", {"worker-1": [0, 2]}),
    ("worker-0@worker-1:2,0,2", {"worker-0": None, "worker-1": [0, 2]}),
])
def test_parse_filter(spec, expected):
    assert parse_filter(spec) == expected


@pytest.mark.parametrize("include, exclude, expected", [
    # DeepSpeed docs: "--include="worker-2:0,1"" uses GPUs 0 and 1 of worker-2 only.
    ("worker-2:0,1", "", {"worker-2": [0, 1]}),
    # DeepSpeed docs: "--exclude="worker-2:0@worker-3:0,1"".
    ("", "worker-2:0@worker-3:0,1", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3],
                                      "worker-2": [1, 2, 3], "worker-3": [2, 3]}),
    # A whole host in, a whole host out; hostfile order is kept, not the filter's.
    ("worker-3@worker-1", "", {"worker-1": [0, 1, 2, 3], "worker-3": [0, 1, 2, 3]}),
    ("", "worker-0@worker-1@worker-2", {"worker-3": [0, 1, 2, 3]}),
    # Excluding every slot of a host drops the host.
    ("", "worker-1:0,1,2,3", {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1, 2, 3],
                              "worker-3": [0, 1, 2, 3]}),
    ("worker-0@worker-1:3", "", {"worker-0": [0, 1, 2, 3], "worker-1": [3]}),
    ("", "", FOUR),
])
def test_filter_resources(include, exclude, expected):
    assert filter_resources(FOUR, include, exclude) == expected


def test_filter_single_node_localhost():
    # DeepSpeed docs: "deepspeed --include localhost:1 train.py" runs on GPU 1 only.
    assert filter_resources({"localhost": [0, 1, 2, 3]}, include="localhost:1") == {"localhost": [1]}


@pytest.mark.parametrize("include, exclude, fragment", [
    ("worker-0", "worker-1", "mutually exclusive"),
    ("worker-9", "", "not in the hostfile"),
    ("", "worker-9:0", "not in the hostfile"),
    ("worker-0:7", "", r"slot\(s\) \[7\]"),
    ("worker-0:a", "", "comma-separated integers"),
    ("worker-0@@worker-1", "", "empty node entry"),
    ("worker-0@worker-0:1", "", "twice"),
    ("", "worker-0@worker-1@worker-2@worker-3", "leave no slots"),
])
def test_filter_errors(include, exclude, fragment):
    with pytest.raises(LaunchError, match=fragment):
        filter_resources(FOUR, include, exclude)


def test_limit_resources():
    assert limit_resources(FOUR, num_nodes=2) == {"worker-0": [0, 1, 2, 3],
                                                  "worker-1": [0, 1, 2, 3]}
    assert limit_resources(FOUR, num_nodes=1, num_gpus=2) == {"worker-0": [0, 1]}
    assert limit_resources({"a": [1, 3]}, num_gpus=1) == {"a": [1]}
    with pytest.raises(LaunchError, match="more nodes"):
        limit_resources(FOUR, num_nodes=5)
    with pytest.raises(LaunchError, match="more than the 4 slot"):
        limit_resources(FOUR, num_gpus=5)
    with pytest.raises(LaunchError, match="invalid"):
        limit_resources(FOUR, num_gpus=0)

"""The code-shape limits of the style guide, enforced where they were last reached.

``shardwise/zero/`` and ``shardwise/offload/`` were reshaped into small files by concern
(issue 19); these tests keep them that way: no file over ``MAX_FILE_LINES`` lines and no
function (or method) over ``MAX_FUNCTION_LINES`` lines, docstring included.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

import pytest

import shardwise

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
PACKAGES = ("zero", "offload")
ROOT = Path(shardwise.__file__).parent


def _files(package: str) -> list:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under shardwise/{package}"
    return files


def _functions(path: Path) -> Iterator[Tuple[str, int]]:
    """``(qualified name, lines)`` of every function in the file, nested ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def walk(node: ast.AST, prefix: str) -> Iterator[Tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_file_is_over_the_line_limit(package: str) -> None:
    long = {str(p.relative_to(ROOT)): n for p in _files(package)
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by concern): {long}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_over_the_line_limit(package: str) -> None:
    long = {f"{p.relative_to(ROOT)}:{name}": n for p in _files(package)
            for name, n in _functions(p) if n > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_function_walk_sees_methods_and_nested_functions(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("class A:\n    def f(self):\n        def g():\n            pass\n"
                   "        return g\n\ndef h():\n    pass\n", encoding="utf-8")
    assert dict(_functions(src)) == {"A.f": 4, "A.f.g": 2, "h": 2}


#: torch.distributed collectives; outside ``shardwise/comm/`` they go through ``shardwise.comm``
#: (its gloo fallbacks and the comms logger see them). Functional collectives inside compiled
#: regions (``_functional_collectives``) are not these calls.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "broadcast", "reduce", "barrier", "send", "recv", "isend", "irecv",
               "all_to_all", "all_to_all_single", "gather", "scatter", "all_gather_object",
               "broadcast_object_list")


def test_collectives_outside_comm_go_through_comm():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if (ROOT / "comm") in path.parents:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in COLLECTIVES and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "dist":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} dist.{node.func.attr}")
    assert not offenders, "collectives outside shardwise/comm/: " + ", ".join(offenders)


#: stream/event calls go through the accelerator (``get_accelerator().Stream/Event/stream/
#: current_stream``) in the packages that move weights and caches between host and device.
STREAM_PACKAGES = ("zero", "offload", "inference", "io")
STREAM_CALLS = ("Stream", "Event", "stream", "current_stream", "mem_get_info")


def test_streams_and_events_go_through_the_accelerator():
    offenders = []
    for package in STREAM_PACKAGES:
        for path in _files(package):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                f = node.func if isinstance(node, ast.Call) else None
                if isinstance(f, ast.Attribute) and f.attr in STREAM_CALLS \
                        and isinstance(f.value, ast.Attribute) and f.value.attr == "cuda" \
                        and isinstance(f.value.value, ast.Name) and f.value.value.id == "torch":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.cuda.{f.attr}")
    assert not offenders, "streams/events outside the accelerator: " + ", ".join(offenders)

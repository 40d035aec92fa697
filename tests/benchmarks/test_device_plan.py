"""scripts/device_plan.sh: every call it lists exists, and every benchmark flag and variant it
passes is one the benchmark defines (a typo would cost a whole device call)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.benchmarks._load import load_bench

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "scripts" / "device_plan.sh"


def _commands() -> list:
    """(script name, argument list) of each ``python3 benchmarks/X.py`` or ``tb`` line of the
    plan's current tree (the issue-19 rows run d43b3fd's script and are not checked here)."""
    text = PLAN.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        m = re.search(r"(?:python3 benchmarks/(\w+)\.py|^\s*tb)\s+(.*)", line)
        if m:
            found.append((m.group(1) or "train_bench", m.group(2).split()))
    return found


def test_the_plan_lists_every_call_it_defines_and_refuses_an_unknown_one():
    listed = subprocess.run(["bash", str(PLAN), "list"], capture_output=True, text=True, check=True)
    names = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    defined = re.findall(r"^run_(\w+)\(\)", PLAN.read_text(), flags=re.M)
    assert sorted(names) == sorted(defined) and len(names) >= 10
    bad = subprocess.run(["bash", str(PLAN), "issue99"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown call 'issue99'" in bad.stdout


def test_every_flag_and_variant_in_the_plan_is_the_benchmarks_own():
    commands = _commands()
    assert {name for name, _ in commands} >= {"train_bench", "rlhf_bench", "decode_probe",
                                              "infer_bench", "zero_inference_bench", "fp8_bench",
                                              "scale_bench", "nvme_scale_bench", "autotune_bench"}
    for name, args in commands:
        source = (ROOT / "benchmarks" / f"{name}.py").read_text()
        for flag in (a for a in args if a.startswith("--")):
            assert f'"{flag}"' in source, f"{name}.py has no {flag} (scripts/device_plan.sh)"
        values = dict(zip(args, args[1:]))
        if "--variants" in values:
            known = load_bench(name).VARIANTS
            for variant in values["--variants"].split(","):
                assert variant.partition("@")[0] in known, f"{name}.py: unknown variant {variant}"
        if "--preset" in values:
            assert values["--preset"] in load_bench(name).PRESETS
        if "--plan" in values:
            assert values["--plan"] in load_bench(name).PLANS


def test_a_call_checks_its_environment_and_packs_its_folder(tmp_path):
    import tarfile
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "device_plan.sh").write_text(PLAN.read_text())
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "device_plan.sh"), "selftest"],
                          capture_output=True, text=True, env={**__import__("os").environ, "OUT": str(out)},
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "shardwise" in done.stdout and "== selftest done" in done.stdout
    with tarfile.open(out / "selftest.tgz") as archive:
        log = archive.extractfile("selftest/selftest.log").read().decode()
    assert "torch " in log and "== selftest done" in log
    assert not (out / "selftest").exists()  # only the archive is left to come back


def test_parallel_runs_each_call_on_its_own_gpu_and_cores(tmp_path):
    import os
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "device_plan.sh").write_text(PLAN.read_text())
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: fake'\necho 'GPU 1: fake'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{fake}:{os.environ['PATH']}"}
    plan = ["bash", str(tmp_path / "scripts" / "device_plan.sh"), "parallel"]
    done = subprocess.run(plan + ["selftest"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "== selftest done" in done.stdout, done.stdout + done.stderr
    assert "GPU 0" in done.stdout and (tmp_path / "out" / "selftest.tgz").exists()
    too_many = subprocess.run(plan + ["selftest", "issue20a", "issue20b"], capture_output=True,
                              text=True, env=env, timeout=60)
    assert too_many.returncode == 2 and "1 to 2 calls" in too_many.stdout


def _function_body(name: str) -> str:
    text = PLAN.read_text()
    return text[text.index(f"{name}() {{"):].split("\n}\n", 1)[0]


@pytest.mark.parametrize("call, at_least", [("gputests", 30), ("gputests3", 10)])
def test_gputests_selects_the_gpu_tests_it_names(call, at_least):
    """The 2026-12-05 gputests call ran 0 tests: pytest.ini deselects ``gpu`` unless asked."""
    body = _function_body(f"run_{call}")
    args = body.split("pytest", 1)[1].split("2>&1")[0].replace("\\\n", " ").split()
    files = [a for a in args if a.startswith("tests/")]
    assert files and all((ROOT / f).is_file() for f in files)
    marker = args[args.index("-m") + 1] if "-m" in args else None
    assert marker == "gpu"
    done = subprocess.run(["python3", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", marker, *files], cwd=ROOT, capture_output=True, text=True)
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(collected) >= at_least, done.stdout[-2000:]


def test_the_wheels_console_scripts_are_on_path():
    """DeepSpeed's autotuner launches ``deepspeed``: the wheels' bin folder must be on PATH."""
    body = _function_body("device_env")
    assert 'export PATH="/tmp/site/bin:$PATH"' in body
    assert "command -v deepspeed" in body

"""scripts/device_plan.sh: every call it lists exists, and every benchmark flag and variant it
passes is one the benchmark defines (a typo would cost a whole device call)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

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

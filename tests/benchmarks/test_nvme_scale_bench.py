"""benchmarks/nvme_scale_bench.py without a GPU: the ladder's sizes, the search, the ZeRO
sections of both modes, and the host-memory cap (its cgroup detection and the watchdog
killing a child that goes over)."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import nvme_scale_bench as bench  # noqa: E402
from _memcap import MemoryCap, cgroup_v2_memory  # noqa: E402


def test_parameter_count_matches_the_llama_7b_shape():
    cfg = bench.trial_config(bench.parse_args([]), 32)
    assert abs(bench.n_params(cfg) - 6_738_415_616) < 1e6  # Llama-2-7B


def test_search_walks_from_the_prediction_then_bisects():
    ladder = list(range(1, 21))
    fits = 13  # layers: the largest that trains

    def run(start):
        tried = []
        bench.search(ladder, start, time.perf_counter() + 1e6,
                     lambda layers, left: tried.append(layers) or
                     ({} if layers <= fits else {"error": "oom"}))
        return tried
    assert run(11) == [12, 13, 14]  # walks up from a low prediction
    assert run(15)[-2:] == [14, 13] and run(15)[0] == 16  # walks down from a high one
    assert run(0)[-1] in (13, 14) and len(run(0)) < 20


def test_modes_put_parameters_and_optimizer_where_they_say(tmp_path):
    cfg = bench.trial_config(bench.parse_args([]), 2)
    cpu = bench.zero_section("cpu", cfg, str(tmp_path), True)
    assert cpu["offload_param"]["device"] == cpu["offload_optimizer"]["device"] == "cpu"
    nvme = bench.zero_section("nvme", cfg, str(tmp_path), True)
    assert nvme["offload_param"]["device"] == nvme["offload_optimizer"]["device"] == "nvme"
    assert nvme["offload_param"]["buffer_size"] >= cfg.vocab * cfg.hidden  # the embedding fits
    params_only = bench.zero_section("nvme", cfg, str(tmp_path), False)
    assert params_only["offload_optimizer"]["device"] == "cpu"


def test_no_cgroup_v2_mount_is_reported(tmp_path):
    assert "not a cgroup v2 mount" in cgroup_v2_memory(tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    assert "memory controller" in cgroup_v2_memory(tmp_path)


def test_watchdog_kills_a_child_over_the_cap(tmp_path):
    cap = MemoryCap(150 * 2**20, prefer_cgroup=False)
    assert cap.kind == "watchdog"
    hog = ("import time; b = bytearray(400 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
           "time.sleep(30)")
    ran = cap.run([sys.executable, "-c", hog], tmp_path / "hog.log", timeout_s=60)
    assert ran.status == "oom" and ran.peak_bytes > 150 * 2**20 and ran.wall_s < 30
    ran = cap.run([sys.executable, "-c", "print('small')"], tmp_path / "ok.log", timeout_s=60)
    assert ran.status == "ok" and (tmp_path / "ok.log").read_text().strip() == "small"


def test_both_modes_pin_exact_size_by_default(monkeypatch):
    """The 2026-12-06 run (torch 2.11: no pinned-rounding setting) put NVMe at 1.27x the
    CPU-offload model, not 2x: power-of-two pinned blocks, not the offload mode, bounded it.
    Trials of both modes now page-lock exactly (the switch is on by default, off on request)."""
    monkeypatch.delenv("SHARDWISE_EXACT_PIN", raising=False)
    assert bench.parse_args([]).exact_pin and not bench.parse_args(["--no-exact-pin"]).exact_pin
    assert bench._child_env(exact_pin=True)["SHARDWISE_EXACT_PIN"] == "1"
    assert "SHARDWISE_EXACT_PIN" not in bench._child_env(exact_pin=False)


def test_first_rung_counts_the_nvme_rings_and_the_disk():
    args = bench.parse_args([])
    ladder = [int(x) for x in args.ladder.split(",")]
    sizes = [bench.n_params(bench.trial_config(args, n)) for n in ladder]
    cpu = ladder[bench.start_rung(ladder, sizes, "cpu", 32.0, 1e9)]
    assert cpu == 6  # (32 - 4) GiB / 18 B: 1.5B parameters
    # 4.5 B/parameter after ~11 GiB of rings and context: 5.0B parameters by host memory
    # (20 layers, 4.3B; 24 would be 5.1B) ...
    assert ladder[bench.start_rung(ladder, sizes, "nvme", 32.0, 1e9)] == 20
    # ... and 50 GiB of free disk holds the 14 B/parameter swap files of 16 layers only
    assert ladder[bench.start_rung(ladder, sizes, "nvme", 32.0, 50.0)] == 16


def test_trial_logs_stay_next_to_the_results(tmp_path, monkeypatch):
    """The logs of trials that went over the cap are what explains them: they are kept in
    ``<out>_logs/`` (a device call brings that folder back), not in a temporary folder."""
    seen = {}

    def fake_run_mode(mode, args, cap, opt_nvme, deadline, log_dir):
        seen[mode] = log_dir
        return [{"mode": mode, "layers": 1, "n_params": 10, "error": "over the cap"}]
    monkeypatch.setattr(bench, "run_mode", fake_run_mode)
    monkeypatch.setattr(bench, "has_nvme_optimizer", lambda path, log_dir: True)
    out = tmp_path / "res" / "i21_scale.json"
    assert bench.main(["--nvme-path", str(tmp_path / "swap"), "--out", str(out), "--no-cgroup",
                       "--max-seconds", "5"]) == 0
    assert seen == {"cpu": out.parent / "i21_scale_logs", "nvme": out.parent / "i21_scale_logs"}
    assert seen["cpu"].is_dir() and out.exists()

"""Autotuning without launching anything: the section, the space, the searches, the probe."""
import base64
import json
import sys
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.autotuning.cli import load_autotuning, read_user_config
from shardwise.autotuning.engine_probe import make_probe
from shardwise.autotuning.memory import MemoryModel
from shardwise.autotuning.runner import TrialCommand, encode_config
from shardwise.autotuning.space import Choice, Experiment, build_space
from shardwise.autotuning.tuner import ChoiceOrder, CostModel, MicroBatchSearch
from shardwise.cli import main as cli_main
from shardwise.config import load_config
from shardwise.errors import ConfigError

SCRIPT = Path(__file__).parent / "autotuning_assets" / "tiny_train.py"


def _at(**kw):
    return load_autotuning({"autotuning": kw})


# --- the section ------------------------------------------------------------------------------
def test_defaults_are_deepspeeds():
    at = _at()
    assert (at.enabled, at.fast, at.results_dir, at.exps_dir, at.overwrite) == \
        (False, True, "autotuning_results", "autotuning_exps", True)
    assert (at.start_profile_step, at.end_profile_step, at.metric, at.tuner_type) == \
        (3, 5, "throughput", "gridsearch")
    assert (at.tuner_early_stopping, at.tuner_num_trials, at.num_tuning_micro_batch_sizes) == (5, 50, 3)
    assert (at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu) == (1, 1024)


def test_autotuning_is_no_longer_an_ignored_section(caplog):
    cfg = load_config({"autotuning": {"enabled": True, "metric": "Latency"}})
    assert cfg.autotuning.metric == "latency"
    assert not any("autotuning" in w and "no effect" in w for w in cfg.warnings)


@pytest.mark.parametrize("section, words", [
    ({"enabld": True}, ["autotuning.enabld", "autotuning.enabled"]),
    ({"metric": "speed"}, ["autotuning.metric", "speed", "throughput"]),
    ({"tuner_type": "bayes"}, ["autotuning.tuner_type", "model_based"]),
    ({"start_profile_step": 5, "end_profile_step": 2}, ["end_profile_step = 2", "start_profile_step = 5"]),
    ({"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 2}, ["max_train_micro"]),
    ({"tuner_num_trials": 0}, ["autotuning.tuner_num_trials", ">= 1"]),
])
def test_bad_autotuning_keys_are_clear_config_errors(section, words):
    with pytest.raises(ConfigError) as err:
        load_autotuning({"autotuning": section})
    for word in words:
        assert word in str(err.value)


@pytest.mark.windows
def test_base64_config_longer_than_a_file_name_loads():
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "autotuning": {"enabled": True, "metric_path": "/tmp/" + "x" * 300 + "/metrics.json"}}
    text = encode_config(cfg)
    assert len(text) > 255  # longer than a file name: Path(text).is_file() raised OSError before
    loaded = load_config(text)
    assert loaded.train_micro_batch_size_per_gpu == 2 and loaded.autotuning.enabled
    assert read_user_config(text)["autotuning"]["metric_path"].endswith("metrics.json")


# --- one-line errors from the command ------------------------------------------------------------
def _run_cli(capsys, argv):
    code = cli_main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_missing_deepspeed_config_is_one_line(capsys):
    code, err = _run_cli(capsys, ["--autotuning", "tune", str(SCRIPT), "--deepspeed"])
    assert code == 2 and "\n" not in err and "--deepspeed_config" in err and "Traceback" not in err


def test_missing_autotuning_section_is_one_line(capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto"}))
    code, err = _run_cli(capsys, ["--autotuning", "run", str(SCRIPT), "--deepspeed_config", str(path)])
    assert code == 2 and "\n" not in err and '"autotuning" section' in err


def test_bad_key_from_the_command_is_one_line(capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"autotuning": {"tuner_typ": "random"}}))
    code, err = _run_cli(capsys, ["--autotuning", "tune", str(SCRIPT), "--deepspeed_config", str(path)])
    assert code == 2 and "autotuning.tuner_type" in err and "Traceback" not in err


# --- the space ----------------------------------------------------------------------------------
def test_space_from_auto_values():
    raw = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto",
           "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"},
                                 "offload_param": "auto"},
           "activation_checkpointing": {"policy": "auto", "modules": ["Block"]},
           "compile": {"enabled": "auto"}}
    space = build_space(raw, _at(max_train_micro_batch_size_per_gpu=32), world_size=2)
    assert space.stages == [0, 1, 2, 3] and space.ac_policies == ["none", "selective", "full"]
    assert space.offload_optimizer == ["none", "cpu"] and space.compile == [False, True]
    choices = space.choices()
    assert Choice(0, "cpu") not in choices  # no offload without ZeRO
    assert all(c.offload_param == "none" or (c.stage == 3 and c.offload_optimizer != "none") for c in choices)
    assert Choice(3, "cpu", "cpu", "none", True) in choices  # stage 3 compiles too
    # the global batch 16 over 2 ranks holds: micro 1..8, GA 8..1; micro 16, 32 cannot
    exps = space.experiments(Choice(2))
    assert [(e.micro_batch, e.grad_accum) for e in exps] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    exp = Experiment(Choice(3, "cpu", "cpu", "full", False), 4, 2, 2)
    assert exp.name == "z3_tmbspg4_gas2_oocpu_opcpu_acfull"
    cfg = space.ds_config(exp, {"enabled": True})
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                        "offload_param": {"device": "cpu"}}
    assert cfg["activation_checkpointing"] == {"policy": "full", "modules": ["Block"]}
    assert cfg["compile"] == {"enabled": False}
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"],
            cfg["gradient_accumulation_steps"]) == (16, 4, 2)
    loaded = load_config(cfg, world_size=2)  # an experiment's config is a valid config
    assert loaded.zero_optimization.stage == 3 and loaded.activation_checkpointing.policy == "full"
    plain = space.ds_config(Experiment(Choice(1), 8, 1, 2), {})
    assert "offload_optimizer" not in plain["zero_optimization"] and "activation_checkpointing" not in plain


def test_fixed_values_are_not_tuned():
    raw = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": 2}, "compile": {"enabled": True}}
    space = build_space(raw, _at(), world_size=1)
    assert space.choices() == [Choice(2, compile=True)] and space.micro_batches == [4]
    assert space.tuned_keys == []


def test_ac_auto_without_modules_is_an_error():
    with pytest.raises(ConfigError, match="activation_checkpointing.modules"):
        build_space({"activation_checkpointing": {"policy": "auto"}}, _at(), 1)


def test_impossible_global_batch_is_an_error():
    with pytest.raises(ConfigError, match="space is empty"):
        build_space({"train_batch_size": 3}, _at(min_train_micro_batch_size_per_gpu=2,
                                                 max_train_micro_batch_size_per_gpu=2), 2)


@pytest.mark.windows
def test_trial_command_passes_base64_like_deepspeed():
    cmd = TrialCommand(["--num_gpus", "1"], "train.py", ["--deepspeed_config", "ds.json", "--bs", "1"],
                       {"train_micro_batch_size_per_gpu": "--bs"})
    cfg = {"train_micro_batch_size_per_gpu": 8}
    argv = cmd.argv(encode_config(cfg), cfg)
    assert argv[:4] == [sys.executable, "-u", "-m", "shardwise"] and "--autotuning" not in argv
    value = argv[argv.index("--deepspeed_config") + 1]
    assert json.loads(base64.urlsafe_b64decode(value)) == cfg
    assert argv[argv.index("--bs") + 1] == "8"


# --- the searches ------------------------------------------------------------------------------
def _exps(sizes):
    return [Experiment(Choice(0), m, 1, 1) for m in sizes]


def test_micro_batch_search_is_a_binary_search():
    exps = _exps([1, 2, 4, 8, 16, 32, 64, 128])
    limit = 16  # sizes above this fail (OOM)
    search = MicroBatchSearch(exps, lambda e: True, num_sizes=2)
    tried = []
    while (e := search.next()) is not None:
        tried.append(e.micro_batch)
        search.record(e, e.micro_batch <= limit)
    assert tried[0] == 128 and 16 in tried and 8 in tried
    assert len(tried) <= 5  # 128, 8, 32, 16 (binary) + 8 measured already -> no sweep of all 8
    assert len(tried) < len(exps)


def test_micro_batch_search_starts_at_the_largest_predicted_fit():
    exps = _exps([1, 2, 4, 8])
    search = MicroBatchSearch(exps, lambda e: e.micro_batch <= 4, num_sizes=1)
    assert search.pruned == 1 and search.next().micro_batch == 4
    search.record(exps[2], True)
    assert search.next() is None


def test_micro_batch_search_gives_up_when_nothing_runs():
    exps = _exps([1, 2])
    search = MicroBatchSearch(exps, lambda e: True)
    search.record(search.next(), False)
    search.record(search.next(), False)
    assert search.next() is None


def test_cost_model_orders_choices():
    model = CostModel()
    for stage, value in ((0, 100.0), (1, 90.0), (2, 80.0)):
        model.add(Choice(stage), 4, value)
    model.add(Choice(1, compile=True), 4, 120.0)
    pending = [Choice(2, compile=True), Choice(0, compile=True), Choice(3)]
    order = ChoiceOrder(pending, "model_based", model, lambda c: 4)
    order.started = 5  # past the warm-up
    assert order.next() == Choice(0, compile=True)
    rnd = ChoiceOrder(pending, "random", model, lambda c: 4, seed=1)
    assert sorted(map(str, rnd.pending)) == sorted(map(str, pending))


def test_memory_model_prunes_what_cannot_fit():
    info = {"num_params": 1_000_000_000, "activation_mem_per_gpu": 2 * 2**30, "micro_batch_size": 1,
            "tokens_per_sample": 2048, "shape": {}}
    mem = MemoryModel.from_model_info(info, "bf16", 1, device_memory=40 * 2**30)
    # 16 bytes/param of model states = 16 GB; + 2 GiB per sample of activations
    assert mem.fits(Choice(0), 4) and not mem.fits(Choice(0), 16)
    assert mem.fits(Choice(0, ac="full"), 16)  # checkpointing keeps a fraction
    assert mem.predict(Choice(2, "cpu"), 1) < mem.predict(Choice(0), 1)
    assert MemoryModel.from_model_info(info, "bf16", 1, None).fits(Choice(0), 1024)


# --- the engine side -------------------------------------------------------------------------------
def test_probe_only_under_the_autotuner(monkeypatch):
    monkeypatch.delenv("SHARDWISE_AUTOTUNING_METRIC_PATH", raising=False)
    assert make_probe(load_config({})) is None
    assert make_probe(load_config({"autotuning": {"enabled": True}})) is None
    assert make_probe(load_config({"autotuning": {"enabled": True, "metric_path": "m.json"}})) is not None


@pytest.mark.windows
def test_engine_writes_metrics_and_exits_after_end_profile_step(tmp_path):
    metrics = tmp_path / "metrics.json"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2,
                          "metric_path": str(metrics)}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    steps = 0
    with pytest.raises(SystemExit) as exit_info:
        for _ in range(20):
            loss = engine(torch.randn(2, 8)).square().mean()
            engine.backward(loss)
            engine.step()
            steps += 1
    assert exit_info.value.code == 0
    assert steps == 5 and engine.global_steps == 3  # 3 optimizer steps x GA 2, exit in the 6th call
    data = json.loads(metrics.read_text())
    assert data["train_batch_size"] == 4 and data["profiled_steps"] == 2
    assert data["throughput"] == pytest.approx(4 / data["latency"]) and data["peak_memory"] > 0


def test_profiling_run_writes_model_info_after_the_first_forward(tmp_path):
    info_path = tmp_path / "model_info.json"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "autotuning": {"enabled": True, "model_info": {"profile": True},
                          "model_info_path": str(info_path)}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    with pytest.raises(SystemExit):
        engine(torch.randn(2, 8))
    info = json.loads(info_path.read_text())
    assert info["num_params"] == 8 * 8 + 8 + 8 * 2 + 2 and info["micro_batch_size"] == 2
    assert info["activation_mem_per_gpu"] == 0  # a CPU has no allocator statistics


def test_probe_counts_whole_parameters_under_stage_3(tmp_path):
    info_path = tmp_path / "model_info.json"
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "param_persistence_threshold": 0},
           "autotuning": {"enabled": True, "model_info": {"profile": True},
                          "model_info_path": str(info_path)}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    with pytest.raises(SystemExit):
        engine(torch.randn(1, 8))
    info = json.loads(info_path.read_text())
    assert info["num_params"] == 8 * 16 + 16 + 16 * 2 + 2
    assert info["shape"]["largest_layer_params"] == 8 * 16 + 16


def test_smaller_micro_batches_stop_once_one_is_worse():
    exps = _exps([1, 2, 4, 8])
    search = MicroBatchSearch(exps, lambda e: True, num_sizes=3)
    throughput = {8: 100.0, 4: 90.0, 2: 80.0, 1: 70.0}
    tried = []
    while (e := search.next()) is not None:
        tried.append(e.micro_batch)
        search.record(e, True, throughput[e.micro_batch])
    assert tried == [8, 4]  # 4 was worse than 8: 2 and 1 are not run


def test_model_based_skips_choices_predicted_well_below_the_best():
    model = CostModel()
    model.add(Choice(0), 8, 100.0)
    model.add(Choice(1), 8, 80.0)  # each stage costs 20 %
    pending = [Choice(2), Choice(3), Choice(1, compile=True)]
    order = ChoiceOrder(pending, "model_based", model, lambda c: 8)
    order.started = 2
    first = order.next(best=100.0)
    # stages 2 and 3 are predicted far below the best; compile was never measured: explored
    assert first == Choice(1, compile=True) and order.skipped == [Choice(2), Choice(3)]
    assert order.next(best=100.0) is None


def test_ac_policy_list_limits_the_choices():
    raw = {"activation_checkpointing": {"policy": ["none", "full"], "modules": ["Block"]}}
    assert build_space(raw, _at(), 1).ac_policies == ["none", "full"]
    with pytest.raises(ConfigError, match="policy"):
        build_space({"activation_checkpointing": {"policy": ["fast"], "modules": ["B"]}}, _at(), 1)


# --- the profiling run as the first trial; micro batches the cost model leaves out ------------
def test_profiling_run_with_a_metric_path_also_times_its_profile_steps(tmp_path):
    info_path, metrics = tmp_path / "model_info.json", tmp_path / "metrics.json"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "autotuning": {"enabled": True, "model_info": {"profile": True},
                          "model_info_path": str(info_path), "metric_path": str(metrics),
                          "start_profile_step": 1, "end_profile_step": 2}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    steps = 0
    with pytest.raises(SystemExit) as exit_info:
        for _ in range(10):
            engine.backward(engine(torch.randn(2, 8)).sum())
            engine.step()
            steps += 1
            assert info_path.exists()  # written after the first forward, and the run goes on
    assert exit_info.value.code == 0 and steps == 2  # exits in the 3rd step, as a trial does
    assert json.loads(info_path.read_text())["micro_batch_size"] == 2
    assert json.loads(metrics.read_text())["profiled_steps"] == 2


def test_micro_batch_search_goes_on_from_a_size_already_measured():
    exps = _exps([4, 8, 16])
    search = MicroBatchSearch(exps, lambda e: True, num_sizes=3)
    search.record(exps[0], True, 35.0)  # the profiling run: smallest size
    assert search.next().micro_batch == 16  # the largest fit next, not the middle
    search.record(exps[2], True, 49.0)
    assert search.next() is None  # 4 was already worse than 16: 8 is not run


def test_micro_batch_search_leaves_out_what_skip_rejects():
    exps = _exps([2, 4, 8, 16])
    search = MicroBatchSearch(exps, lambda e: True, num_sizes=3, skip=lambda e: e.micro_batch < 16)
    assert search.next().micro_batch == 16
    search.record(exps[3], True, 50.0)
    assert search.next() is None
    plain = MicroBatchSearch(exps, lambda e: True, num_sizes=3)
    plain.record(exps[3], True, 50.0)
    assert plain.next().micro_batch == 8  # without skip the smaller sizes are measured


class _TableRunner:
    """A runner that answers from measured numbers instead of launching (names -> samples/s);
    the profiling run also writes the model_info.json a 1.1B Llama's first forward gives."""

    def __init__(self, table):
        self.table, self.ran = table, []

    def run(self, name, ds_config):
        from shardwise.autotuning.runner import TrialResult
        self.ran.append(name)
        section = ds_config.get("autotuning", {})
        if section.get("model_info", {}).get("profile"):
            info = {"num_params": 1_100_000_000, "micro_batch_size": 4, "tokens_per_sample": 1024,
                    "activation_mem_per_gpu": 4 * 2**30, "shape": {"largest_layer_params": 65_536_000}}
            Path(section["model_info_path"]).parent.mkdir(parents=True, exist_ok=True)
            Path(section["model_info_path"]).write_text(json.dumps(info))
            name = "z%d_tmbspg%d_gas1" % (ds_config["zero_optimization"]["stage"],
                                          ds_config["train_micro_batch_size_per_gpu"])
        return TrialResult(name, "ok", {"throughput": self.table[name]}, 1.0)


# samples/s of the 1.1B Llama grid on an H100 (benchmarks/RESULTS.md, eleventh session)
_H100_QUICK = {"z0_tmbspg4_gas1": 35.5, "z0_tmbspg8_gas1": 44.6, "z0_tmbspg16_gas1": 48.8,
               "z0_tmbspg4_gas1_acfull": 12.1, "z0_tmbspg8_gas1_acfull": 22.0,
               "z0_tmbspg16_gas1_acfull": 30.0, "z1_tmbspg4_gas1": 35.4, "z1_tmbspg8_gas1": 44.6,
               "z1_tmbspg16_gas1": 48.7, "z1_tmbspg4_gas1_acfull": 11.3,
               "z1_tmbspg8_gas1_acfull": 24.6, "z1_tmbspg16_gas1_acfull": 30.7}


def test_model_based_tune_of_the_measured_grid_adopts_the_profiling_run(tmp_path, monkeypatch):
    """On the H100 grid's numbers: the profiling run (stage 1, micro batch 4) counts as the
    first trial, the cost model leaves out stage 0's micro batch 8, and the pick is the grid's
    best in 3 launches of 12 (before: a profiling launch + 4 trials)."""
    from shardwise.autotuning import cli
    from shardwise.autotuning.autotuner import Autotuner
    raw = {"train_micro_batch_size_per_gpu": [4, 8, 16], "zero_optimization": {"stage": [0, 1]},
           "bf16": {"enabled": True},
           "activation_checkpointing": {"policy": ["none", "full"], "modules": ["Block"]}}
    at = _at(tuner_type="model_based", min_train_micro_batch_size_per_gpu=4,
             max_train_micro_batch_size_per_gpu=16)
    space = build_space(raw, at, 1)
    assert space.grid_size() == 12
    tuner = Autotuner(space, at, TrialCommand(["python"], "train.py", []), base_dir=tmp_path)
    tuner.runner = runner = _TableRunner(_H100_QUICK)
    monkeypatch.setattr(cli, "_device_memory", lambda: 80 * 2**30)
    tuner.memory = cli._memory_model(tuner, space, raw)
    assert tuner.memory is not None and [r.exp.name for r in tuner.records] == ["z1_tmbspg4_gas1"]
    outcome = tuner.tune()
    assert runner.ran == ["profile_model_info", "z0_tmbspg16_gas1", "z1_tmbspg16_gas1"]
    assert outcome.best.exp.name == "z0_tmbspg16_gas1" and outcome.trials_run == 3
    assert (tmp_path / at.results_dir / "ds_config_optimal.json").exists()

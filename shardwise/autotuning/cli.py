"""``shardwise --autotuning tune|run [launcher flags] train.py ... --deepspeed_config ds.json``.

``tune`` runs the experiments and writes the result files; ``run`` does the same (finished
experiments are reused, so after a tune it only reads them back) and then launches the
training with the best config, as DeepSpeed's ``--autotuning run`` does.
"""
from __future__ import annotations

import json
import subprocess
from typing import Any, Dict, List, Optional, Sequence

from ..errors import ConfigError, LaunchError
from .autotuner import Autotuner, _print
from .config import AutotuningConfig
from .memory import MemoryModel
from .runner import TrialCommand
from .space import Choice, Experiment, TuningSpace, build_space

PROFILE_NAME = "profile_model_info"


def _config_value(script_args: Sequence[str]) -> str:
    for i, token in enumerate(script_args):
        if token == "--deepspeed_config" and i + 1 < len(script_args):
            return script_args[i + 1]
        if token.startswith("--deepspeed_config="):
            return token.split("=", 1)[1]
    raise LaunchError("--autotuning needs the script's --deepspeed_config ds_config.json (the config "
                      "with the \"autotuning\" section and the \"auto\" values to tune); add it after "
                      "the script")


def _launcher_tokens(argv: Sequence[str]) -> List[str]:
    """The launcher flags of ``argv`` without --autotuning and its value."""
    from ..launcher.cli_args import split_argv
    tokens, _, _ = split_argv(argv)
    out, skip = [], False
    for token in tokens:
        if skip:
            skip = False
            continue
        if token == "--autotuning":
            skip = True
            continue
        if token.startswith("--autotuning="):
            continue
        out.append(token)
    return out


def read_user_config(value: str) -> Dict[str, Any]:
    """The user's raw config (``"auto"`` values kept), and its validated autotuning section."""
    from ..config.loader import _from_string
    raw = _from_string(value)
    if "autotuning" not in raw:
        raise ConfigError(f"--autotuning needs an \"autotuning\" section in {value!r}; add e.g. "
                          f"\"autotuning\": {{\"enabled\": true, \"metric\": \"throughput\"}}")
    return raw


def load_autotuning(raw: Dict[str, Any]) -> AutotuningConfig:
    """Validate the section strictly: an unknown or bad key is a ConfigError naming it."""
    from ..config.loader import load_config
    section = raw["autotuning"]
    if not isinstance(section, dict):
        raise ConfigError(f"autotuning = {section!r} must be an object, e.g. {{\"enabled\": true}}")
    return load_config({"autotuning": section}, strict=True).autotuning


def _precision(raw: Dict[str, Any]) -> str:
    """The estimator's precision name, read from the raw config (it may hold lists/"auto")."""
    for key in ("bf16", "bfloat16", "fp16"):
        section = raw.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return "fp16" if key == "fp16" else "bf16"
    return "fp32"


def _device_memory() -> Optional[int]:
    from ..accelerator import get_accelerator
    accel = get_accelerator()
    return int(accel.total_memory()) if accel.kind != "cpu" else None


def _memory_model(tuner: Autotuner, space: TuningSpace, raw: Dict[str, Any]) -> Optional[MemoryModel]:
    """Calibrate the memory model with one profiling trial (skipped when nothing can be pruned)."""
    device_memory = _device_memory()
    if device_memory is None:
        _print("device memory unknown (CPU): no pruning by the memory estimator")
        return None
    info_path = tuner.exps_dir / PROFILE_NAME / "model_info.json"
    choice = Choice(stage=max(space.stages))
    of_choice = space.experiments(choice) if choice in space.choices() else []
    in_space = bool(of_choice)
    exp = of_choice[0] if in_space else Experiment(choice, space.micro_batches[0], 1, space.world_size)
    # the profiling run also times its profile steps: where its config is one of the space's
    # experiments (the highest stage's plain variant at the smallest micro batch), that is
    # the tune's first trial instead of a launch spent on calibration alone
    section = {"enabled": True, "model_info": {"profile": True}, "model_info_path": str(info_path),
               "metric_path": str(info_path.with_name("metrics.json")),
               "start_profile_step": tuner.at.start_profile_step,
               "end_profile_step": tuner.at.end_profile_step}
    cfg = space.ds_config(exp, section)
    cfg["train_batch_size"] = exp.train_batch_size
    _print(f"profiling the model ({PROFILE_NAME}: stage {choice.stage}, micro batch {exp.micro_batch}"
           f"{f', also trial {exp.name}' if in_space else ''})")
    result = tuner.runner.run(PROFILE_NAME, cfg)
    if in_space:
        tuner.adopt(exp, result)
    if not info_path.exists():
        _print(f"profiling run failed ({result.status}: {result.error}); tuning without pruning")
        return None
    info = json.loads(info_path.read_text(encoding="utf-8"))
    model = MemoryModel.from_model_info(info, _precision(raw), space.world_size,
                                        device_memory)
    _print(f"model: {info['num_params'] / 1e6:.1f}M parameters, activations "
           f"{model.activation_per_sample / 2**20:.1f} MiB per sample; device {device_memory / 2**30:.1f} GiB")
    return model


def autotune(args: Any, argv: Sequence[str]) -> int:
    """Entry from the launcher (``args``: its LaunchArgs, ``argv``: the whole command line)."""
    from ..launcher.launch import resolve_resources
    mode = args.options.autotuning
    raw = read_user_config(_config_value(args.script_args))
    at = load_autotuning(raw)
    resources, _ = resolve_resources(args)
    world_size = sum(len(slots) for slots in resources.values())
    space = build_space(raw, at, world_size)
    command = TrialCommand(_launcher_tokens(argv), args.script, list(args.script_args),
                           dict(at.arg_mappings or {}))
    tuner = Autotuner(space, at, command)
    tuner.memory = _memory_model(tuner, space, raw)
    outcome = tuner.tune()
    if outcome.best is None:
        return 1
    if mode == "run":
        cmd = tuner.optimal_command()
        _print(f"launching the training with the best config: {' '.join(cmd)}")
        return subprocess.call(cmd)
    return 0

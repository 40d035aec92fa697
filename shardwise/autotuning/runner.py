"""One trial: the user's command with the experiment's config, through the launcher.

The experiment's ds_config reaches the script as DeepSpeed's autotuner passes it: base64
JSON as the value of ``--deepspeed_config``. Each experiment gets a folder under exps_dir
with ``cmd.txt``, ``ds_config.json``, ``stdout.log``, ``stderr.log``, the engine's
``metrics.json`` and our ``result.json`` (status, metric, time). A folder with a
``result.json`` and the same ds_config is reused, so an interrupted tune resumes. A trial
that runs past ``trial_timeout`` is stopped (its whole process tree) and recorded.
"""
from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from .config import METRIC_PATH_ENV

OOM_MARKERS = ("out of memory", "outofmemoryerror", "can't allocate memory",
               "defaultcpuallocator: can't allocate", "cuda error: out of memory")


@dataclass
class TrialResult:
    """What one experiment gave."""

    name: str
    status: str
    """"ok" | "oom" | "error" | "timeout" | "no_metrics"."""
    metrics: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""
    """The last line of stderr for a failed trial."""
    reused: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def value(self, metric: str) -> Optional[float]:
        """The tuned metric (None when missing)."""
        value = self.metrics.get(metric)
        return float(value) if isinstance(value, (int, float)) else None


@dataclass
class TrialCommand:
    """How to run the user's job with another config."""

    launcher_args: List[str]
    """Launcher flags, without --autotuning."""
    script: str
    script_args: List[str]
    """Script flags; the value after --deepspeed_config is replaced per experiment."""
    arg_mappings: Dict[str, str] = field(default_factory=dict)

    def argv(self, config_value: str, ds_config: Optional[Dict[str, Any]] = None) -> List[str]:
        args = list(self.script_args)
        _set_flag(args, "--deepspeed_config", config_value)
        for key, flag in self.arg_mappings.items():
            value = _lookup(ds_config or {}, key)
            if value is not None:
                _set_flag(args, flag, str(value))
        return [sys.executable, "-u", "-m", "shardwise", *self.launcher_args, self.script, *args]


def _lookup(cfg: Dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def _set_flag(args: List[str], flag: str, value: str) -> None:
    for i, token in enumerate(args):
        if token == flag and i + 1 < len(args):
            args[i + 1] = value
            return
        if token.startswith(flag + "="):
            args[i] = f"{flag}={value}"
            return
    args.extend([flag, value])


def encode_config(ds_config: Dict[str, Any]) -> str:
    """DeepSpeed's encoding: url-safe base64 of the JSON text."""
    return base64.urlsafe_b64encode(json.dumps(ds_config).encode("utf-8")).decode("ascii")


def _classify(rc: int, timed_out: bool, metrics_file: Path, stderr_file: Path, stdout_file: Path) -> tuple:
    if timed_out:
        return "timeout", "stopped after the trial timeout (autotuning.trial_timeout)"
    text = ""
    for path in (stderr_file, stdout_file):
        if path.exists():
            text += path.read_text(encoding="utf-8", errors="replace")[-20000:]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if rc == 0 and metrics_file.exists():
        return "ok", ""
    lowered = text.lower()
    if any(marker in lowered for marker in OOM_MARKERS):
        return "oom", next((ln for ln in reversed(lines) if "memory" in ln.lower()), "out of memory")
    if rc == 0:
        return "no_metrics", ("the script ended before end_profile_step; run more steps or lower "
                              "autotuning.end_profile_step")
    err = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    return "error", f"exit code {rc}: {err}"[:400]


def _same_experiment(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Equal configs, where the result paths (which follow exps_dir around) do not count."""
    def strip(cfg: Dict[str, Any]) -> Dict[str, Any]:
        cfg = dict(cfg)
        section = {k: v for k, v in dict(cfg.get("autotuning") or {}).items()
                   if k not in ("metric_path", "model_info_path")}
        cfg["autotuning"] = section
        return cfg
    return strip(a) == strip(b)


def kill_tree(proc: subprocess.Popen) -> None:
    """Stop a trial's launcher and every worker under it (any OS)."""
    try:
        import psutil
        parent = psutil.Process(proc.pid)
        children = parent.children(recursive=True)
        for p in children + [parent]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    except Exception:  # noqa: BLE001 - the process may be gone already
        proc.kill()
    proc.wait()


class TrialRunner:
    """Runs experiments one after another; reuses finished ones."""

    def __init__(self, command: TrialCommand, exps_dir: Path, timeout: float, overwrite: bool) -> None:
        self.command = command
        self.exps_dir = exps_dir
        self.timeout = timeout
        self.overwrite = overwrite

    def finished(self, name: str, ds_config: Dict[str, Any]) -> Optional[TrialResult]:
        """The recorded result of ``name`` if it can be reused, else None (folder cleared)."""
        folder = self.exps_dir / name
        result_file = folder / "result.json"
        if result_file.exists():
            try:
                stored = json.loads((folder / "ds_config.json").read_text(encoding="utf-8"))
                data = json.loads(result_file.read_text(encoding="utf-8"))
                if _same_experiment(stored, ds_config) or not self.overwrite:
                    data["reused"] = True
                    return TrialResult(**data)
            except (OSError, ValueError, TypeError):
                pass
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        return None

    def run(self, name: str, ds_config: Dict[str, Any]) -> TrialResult:
        previous = self.finished(name, ds_config)
        if previous is not None:
            return previous
        folder = self.exps_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ds_config.json").write_text(json.dumps(ds_config, indent=2), encoding="utf-8")
        argv = self.command.argv(encode_config(ds_config), ds_config)
        (folder / "cmd.txt").write_text(shlex.join(argv) + "\n", encoding="utf-8")
        metrics_file = Path(ds_config["autotuning"]["metric_path"])
        env = dict(os.environ)
        env[METRIC_PATH_ENV] = str(metrics_file)
        start = time.perf_counter()
        timed_out = False
        with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
            try:
                rc = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                rc, timed_out = -1, True
            except KeyboardInterrupt:
                kill_tree(proc)
                shutil.rmtree(folder, ignore_errors=True)  # unfinished: rerun on resume
                raise
        seconds = time.perf_counter() - start
        status, error = _classify(rc, timed_out, metrics_file, folder / "stderr.log", folder / "stdout.log")
        metrics = json.loads(metrics_file.read_text(encoding="utf-8")) if status == "ok" else {}
        result = TrialResult(name, status, metrics, seconds, error)
        data = asdict(result)
        data.pop("reused")
        (folder / "result.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
        return result

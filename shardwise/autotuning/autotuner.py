"""The tuning loop and its result files.

1. Read the space from the user's config (``space``); if the device memory is known, run
   one profiling trial (``model_info``) and build the memory model (``memory``). That run
   also times its profile steps, so where its config is in the space it is the first
   experiment (``adopt``) and the micro batch search of its choice goes on from it.
2. Take choices in the tuner's order (``tuner.ChoiceOrder``); for each, run the micro batch
   search (``tuner.MicroBatchSearch``) through the trial runner (``runner``), one trial at a
   time. Stop at ``tuner_num_trials`` trials or after ``tuner_early_stopping`` trials in a
   row without a better metric.
3. Write results_dir/ds_config_optimal.json, cmd_optimal.txt and summary.txt.

``fast`` (the default): per stage only the plain variant (no offload, no checkpointing,
no compile) unless that variant cannot run at all; then ``compile`` on the best choice.
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from .config import AutotuningConfig
from .memory import MemoryModel
from .runner import TrialCommand, TrialResult, TrialRunner
from .space import Choice, Experiment, TuningSpace
from .tuner import MODEL_SKIP_MARGIN, ChoiceOrder, CostModel, MicroBatchSearch


@dataclass
class Record:
    """One finished experiment."""

    exp: Experiment
    result: TrialResult


@dataclass
class TuneOutcome:
    """What ``Autotuner.tune`` found."""

    best: Optional[Record]
    records: List[Record] = field(default_factory=list)
    seconds: float = 0.0
    pruned: int = 0
    stopped: str = ""

    @property
    def trials_run(self) -> int:
        return sum(1 for r in self.records if not r.result.reused)


def _print(text: str) -> None:
    print(f"[autotuning] {text}", flush=True)


class Autotuner:
    """Runs the experiments of one user config and writes DeepSpeed's result files."""

    def __init__(self, space: TuningSpace, at: AutotuningConfig, command: TrialCommand,
                 memory: Optional[MemoryModel] = None, base_dir: Path = Path(".")) -> None:
        self.space = space
        self.at = at
        self.command = command
        self.memory = memory
        self.results_dir = (base_dir / at.results_dir).resolve()
        self.exps_dir = (base_dir / at.exps_dir).resolve()
        self.runner = TrialRunner(command, self.exps_dir, at.trial_timeout, at.overwrite)
        self.higher_is_better = at.metric != "latency"
        self.model = CostModel()
        self.records: List[Record] = []
        self.best: Optional[Record] = None
        self._since_best = 0
        self._start = 0.0
        self._grid_left = space.grid_size()
        self._pruned = 0

    # --- one experiment ------------------------------------------------------------------
    def _autotuning_section(self, exp: Experiment) -> Dict[str, Any]:
        return {"enabled": True, "metric": self.at.metric,
                "start_profile_step": self.at.start_profile_step,
                "end_profile_step": self.at.end_profile_step,
                "metric_path": str(self.exps_dir / exp.name / "metrics.json")}

    def score(self, result: Optional[TrialResult]) -> Optional[float]:
        """The metric as "higher is better" (1/latency), None without one."""
        value = result.value(self.at.metric) if result is not None and result.ok else None
        if value is None or value <= 0:
            return None
        return value if self.higher_is_better else 1.0 / value

    def _better(self, value: float, than: float) -> bool:
        return value > than if self.higher_is_better else value < than

    def run_experiment(self, exp: Experiment) -> TrialResult:
        ds_config = self.space.ds_config(exp, self._autotuning_section(exp))
        index = len(self.records) + 1
        _print(f"trial {index}/{self._planned()} {exp.name} ({exp.choice.describe()}, micro batch "
               f"{exp.micro_batch}, GA {exp.grad_accum}) ...")
        return self.adopt(exp, self.runner.run(exp.name, ds_config))

    def adopt(self, exp: Experiment, result: TrialResult) -> TrialResult:
        """Record a finished run of ``exp`` (a trial, or the profiling run when its config is
        one of the space's experiments): best, cost model, progress line."""
        record = Record(exp, result)
        self.records.append(record)
        value = result.value(self.at.metric)
        if result.ok and value is not None:
            self.model.add(exp.choice, exp.micro_batch, self.score(result) or 0.0)
            if self.best is None or self._better(value, self.best.result.value(self.at.metric) or 0.0):
                self.best, self._since_best = record, 0
            else:
                self._since_best += 1
        else:
            self._since_best += 1
        self._report(record)
        return result

    def _report(self, record: Record) -> None:
        r = record.result
        if r.ok:
            peak = r.metrics.get("peak_memory") or 0
            text = (f"{r.metrics.get(self.at.metric, 0):.4g} {self.at.metric}, "
                    f"{r.metrics.get('throughput', 0):.4g} samples/s, peak {peak / 2**30:.2f} GiB")
        else:
            text = f"{r.status.upper()}: {r.error}"
        done = [x.result.seconds for x in self.records if not x.result.reused]
        left = max(self._planned() - len(done), 0) * (sum(done) / len(done) if done else 0.0)
        best = self.best.exp.name if self.best else "none yet"
        _print(f"  -> {text} ({'reused' if r.reused else f'{r.seconds:.1f} s'}); best {best}; "
               f"at most ~{left:.0f} s left")

    def _planned(self) -> int:
        return min(self.at.tuner_num_trials, self._grid_left + len(self.records))

    # --- the loop ----------------------------------------------------------------------------
    def _search(self, choice: Choice) -> bool:
        """Run ``choice``'s micro batch search; True when some micro batch ran."""
        fits = (lambda e: self.memory.fits(e.choice, e.micro_batch)) if self.memory else (lambda e: True)
        search = MicroBatchSearch(self.space.experiments(choice), fits,
                                  self.at.num_tuning_micro_batch_sizes, skip=self._predicted_worse)
        self._pruned += search.pruned
        self._grid_left -= search.pruned
        any_ok = False
        for rec in self.records:  # already measured (the profiling run): the search goes on from it
            if rec.exp in search.candidates:
                search.record(rec.exp, rec.result.ok, self.score(rec.result))
                any_ok = any_ok or rec.result.ok
        while (exp := search.next()) is not None:
            if self._stop_reason():
                break
            result = self.run_experiment(exp)
            self._grid_left -= 1
            search.record(exp, result.ok, self.score(result))
            any_ok = any_ok or result.ok
        return any_ok

    def _predicted_worse(self, exp: Experiment) -> bool:
        """model_based: a smaller micro batch is skipped like a choice is, when the cost model
        is confident and predicts it more than MODEL_SKIP_MARGIN below the best found."""
        if self.at.tuner_type != "model_based" or self.best is None:
            return False
        if not self.model.well_below(exp.choice, exp.micro_batch, self.score(self.best.result)):
            return False
        _print(f"skipping {exp.name}: the cost model predicts it more than {MODEL_SKIP_MARGIN:.0%} "
               f"below the best")
        return True

    def _stop_reason(self) -> str:
        run = len(self.records)
        if run >= self.at.tuner_num_trials:
            return f"tuner_num_trials ({self.at.tuner_num_trials}) reached"
        if self.best is not None and self._since_best >= self.at.tuner_early_stopping:
            return f"no better metric in {self._since_best} trials (tuner_early_stopping)"
        return ""

    def _largest_fitting(self, choice: Choice) -> int:
        exps = self.space.experiments(choice)
        if self.memory is not None:
            fitting = [e for e in exps if self.memory.fits(choice, e.micro_batch)]
            exps = fitting or exps[:1]
        return exps[-1].micro_batch

    def _fast_plan(self, choices: List[Choice]) -> List[Choice]:
        """Plain variant per stage (no offload/checkpointing/compile) where the space has one."""
        def plainness(c: Choice) -> tuple:
            return (c.offload_level != "none", c.ac != "none" and "none" in self.space.ac_policies,
                    c.compile != self.space.compile[0])
        plain = []
        for stage in self.space.stages:
            of_stage = [c for c in choices if c.stage == stage]
            if of_stage:
                plain.append(min(of_stage, key=plainness))
        return plain

    def tune(self) -> TuneOutcome:
        self._start = time.perf_counter()
        self._pruned = 0
        choices = self.space.choices()
        self._grid_left = self.space.grid_size() - len(self.records)  # minus the profiling run
        _print(f"space: {len(choices)} choice(s) x micro batch {self.space.micro_batches} = "
               f"{self.space.grid_size()} experiment(s); tuned: {', '.join(self.space.tuned_keys) or 'nothing'}; "
               f"tuner {self.at.tuner_type}{', fast' if self.at.fast else ''}")
        first = self._fast_plan(choices) if self.at.fast else choices
        self._reported_skips = 0
        order = ChoiceOrder(first, self.at.tuner_type, self.model, self._largest_fitting)
        tried: List[Choice] = []
        stopped = ""
        while (choice := order.next(self.score(self.best.result) if self.best else None)) is not None:
            stopped = self._stop_reason()
            if stopped:
                break
            for skipped in order.skipped[self._reported_skips:]:
                _print(f"skipping {skipped.describe()}: the cost model predicts it more than "
                       f"{MODEL_SKIP_MARGIN:.0%} below the best")
            self._reported_skips = len(order.skipped)
            tried.append(choice)
            ran = self._search(choice)
            if self.at.fast and not ran:
                # the plain variant cannot run: the memory-saving variants of that stage may
                rest = [c for c in choices if c.stage == choice.stage and c not in tried
                        and c.compile == choice.compile]
                order.pending = rest + order.pending
        if self.at.fast and not stopped and self.best is not None and len(self.space.compile) > 1:
            b = self.best.exp.choice
            other = Choice(b.stage, b.offload_optimizer, b.offload_param, b.ac, not b.compile)
            if other in choices and not self._stop_reason():
                self._search(other)
        stopped = stopped or self._stop_reason() or "space exhausted"
        outcome = TuneOutcome(self.best, self.records, time.perf_counter() - self._start,
                              self._pruned, stopped)
        self.write_results(outcome)
        return outcome

    def exhaustive(self) -> TuneOutcome:
        """Every experiment of the space, no pruning, no early stop (the benchmark's grid)."""
        self._start = time.perf_counter()
        self._grid_left, self._pruned = self.space.grid_size(), 0
        for choice in self.space.choices():
            for exp in self.space.experiments(choice):
                self.run_experiment(exp)
                self._grid_left -= 1
        outcome = TuneOutcome(self.best, self.records, time.perf_counter() - self._start, 0,
                              "grid exhausted")
        self.write_results(outcome)
        return outcome

    # --- result files ----------------------------------------------------------------------
    def optimal_command(self) -> List[str]:
        return self.command.argv(str(self.results_dir / "ds_config_optimal.json"),
                                 self._optimal_config())

    def _optimal_config(self) -> Dict[str, Any]:
        assert self.best is not None
        cfg = self.space.ds_config(self.best.exp, {})
        cfg.pop("autotuning", None)
        return cfg

    def write_results(self, outcome: TuneOutcome) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / "summary.txt").write_text(self.summary(outcome), encoding="utf-8")
        if outcome.best is None:
            _print(f"no experiment ran successfully; see {self.results_dir / 'summary.txt'}")
            return
        (self.results_dir / "ds_config_optimal.json").write_text(
            json.dumps(self._optimal_config(), indent=2), encoding="utf-8")
        (self.results_dir / "cmd_optimal.txt").write_text(shlex.join(self.optimal_command()) + "\n",
                                                          encoding="utf-8")
        b = outcome.best
        _print(f"best: {b.exp.name} ({b.result.value(self.at.metric):.4g} {self.at.metric}) after "
               f"{len(outcome.records)} experiment(s) in {outcome.seconds:.0f} s ({outcome.stopped}); "
               f"wrote {self.results_dir / 'ds_config_optimal.json'} and cmd_optimal.txt")

    def summary(self, outcome: TuneOutcome) -> str:
        m = self.at.metric
        lines = [f"autotuning summary: metric {m}, tuner {self.at.tuner_type}"
                 f"{' (fast)' if self.at.fast else ''}; {len(outcome.records)} experiment(s) "
                 f"({outcome.trials_run} run now, the rest reused), {outcome.pruned} pruned by the "
                 f"memory estimator, {outcome.seconds:.1f} s; stopped: {outcome.stopped}",
                 f"{'experiment':<40}{'status':<11}{m:>14}{'samples/s':>12}{'latency s':>11}"
                 f"{'peak GiB':>10}{'time s':>8}  config"]
        for rec in outcome.records:
            r = rec.result
            num = lambda k, f: (f.format(r.metrics[k]) if isinstance(r.metrics.get(k), (int, float)) else "-")  # noqa: E731
            peak = r.metrics.get("peak_memory")
            mark = " *" if outcome.best is rec else ""
            lines.append(f"{rec.exp.name + mark:<40}{r.status:<11}{num(m, '{:.5g}'):>14}"
                         f"{num('throughput', '{:.4g}'):>12}{num('latency', '{:.4g}'):>11}"
                         f"{(f'{peak / 2**30:.2f}' if peak else '-'):>10}{r.seconds:>8.1f}  "
                         f"{rec.exp.choice.describe()}, micro batch {rec.exp.micro_batch}, GA "
                         f"{rec.exp.grad_accum}" + (f"  [{r.error}]" if r.error else ""))
        if outcome.best is not None:
            lines.append(f"best: {outcome.best.exp.name} (*)")
        return "\n".join(lines) + "\n"

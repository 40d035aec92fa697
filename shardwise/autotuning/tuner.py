"""Which experiment runs next: the micro batch search of one choice, and the order of choices.

* ``MicroBatchSearch``: for one choice, a binary search for the largest micro batch that
  runs (starting at the largest one the memory model lets through), then the next smaller
  candidates until ``num_tuning_micro_batch_sizes`` sizes have a metric.
* ``ChoiceOrder``: the order of choices. ``gridsearch``: the space's order; ``random``: a
  seeded shuffle; ``model_based``: after ``MODEL_WARMUP`` choices in grid order, the choice
  whose best predicted metric is highest under ``CostModel``.
* ``CostModel``: a ridge regression of log(metric) on features of a choice (ZeRO stage and
  checkpointing level as ordinals, offload and compile as 0/1) and log2(micro batch), fitted
  on the finished trials. Simple on purpose: a handful of trials is all it ever sees. The
  model-based order also skips a choice the model is confident about (``confident``) and
  predicts more than ``MODEL_SKIP_MARGIN`` below the best metric found.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .space import Choice, Experiment

MODEL_WARMUP = 2
"""Choices run in grid order before the cost model picks (it needs a contrast to fit)."""
RIDGE = 1e-2
MODEL_SKIP_MARGIN = 0.10
"""model_based skips a choice predicted this fraction below the best metric found."""


@dataclass
class MicroBatchSearch:
    """Binary search for the largest micro batch that runs, then a few smaller ones."""

    candidates: List[Experiment]
    """Ascending micro batch."""
    fits: Callable[[Experiment], bool]
    """The memory model's verdict (True when unknown)."""
    num_sizes: int = 3
    skip: Callable[[Experiment], bool] = lambda e: False
    """For the smaller sizes after the largest that runs: True leaves that size out
    (model_based: the cost model predicts it well below the best)."""
    ok: Dict[int, bool] = field(default_factory=dict)
    """Index -> ran (True) or failed (False)."""
    metrics: Dict[int, float] = field(default_factory=dict)
    """Index -> metric (higher is better) of the sizes that ran."""

    def __post_init__(self) -> None:
        fitting = [i for i, e in enumerate(self.candidates) if self.fits(e)]
        self._lo = -1  # largest index known to run
        self._hi = (max(fitting) + 1) if fitting else 0  # smallest index known (or predicted) to fail
        self.pruned = len(self.candidates) - self._hi

    def next(self) -> Optional[Experiment]:
        """The next experiment of this choice, or None when it is done."""
        if self._hi - self._lo > 1:
            # the largest predicted fit first, unless a size above the known good one has failed
            untried_above = not any(i > self._lo for i in self.ok)
            probe = self._hi - 1 if untried_above else (self._lo + self._hi + 1) // 2
            return self.candidates[probe]
        if self._lo < 0:
            return None
        measured = sum(1 for v in self.ok.values() if v)
        below = [i for i in self.metrics if i < self._lo]
        if below and self.metrics[min(below)] < max(self.metrics.values()):
            return None  # a smaller size was already worse: smaller still will not win
        for i in range(self._lo - 1, -1, -1):
            if measured >= self.num_sizes:
                break
            if i not in self.ok:
                if self.skip(self.candidates[i]):
                    return None  # smaller still is predicted worse again
                return self.candidates[i]
        return None

    def record(self, exp: Experiment, ran: bool, metric: Optional[float] = None) -> None:
        """``metric``: higher is better (pass 1/latency for latency)."""
        i = self.candidates.index(exp)
        self.ok[i] = ran
        if ran and metric is not None:
            self.metrics[i] = metric
        if ran:
            self._lo = max(self._lo, i)
        elif i <= self._lo:
            pass  # a smaller size failed for another reason: keep the bounds
        else:
            self._hi = min(self._hi, i)


ORDINAL_FEATURES = (1, 4)
"""Indices in ``features`` of the ordinal ones (stage, checkpointing level)."""
AC_LEVEL = {"none": 0.0, "selective": 1.0, "selective_ops": 1.0, "offload": 1.5, "full": 2.0}


def features(choice: Choice, micro_batch: int) -> List[float]:
    """Ordinal where an order is expected (a higher stage or more recompute costs more)."""
    return [1.0, float(choice.stage), float(choice.offload_optimizer != "none"),
            float(choice.offload_param != "none"), AC_LEVEL.get(choice.ac, 1.0),
            float(choice.compile), math.log2(micro_batch)]


class CostModel:
    """Ridge regression of log(metric) on ``features``; higher prediction = better.

    ``confident(choice)``: each 0/1 feature of ``choice`` takes a value the finished trials
    have shown, and each ordinal one (stage, checkpointing level) was seen or has varied among
    them, so a trend can be extrapolated; otherwise the model would only be guessing, and the
    choice is explored instead of skipped.
    """

    def __init__(self) -> None:
        self.rows: List[List[float]] = []
        self.targets: List[float] = []
        self.weights: Optional[torch.Tensor] = None

    def add(self, choice: Choice, micro_batch: int, score: float) -> None:
        """``score``: higher is better (the autotuner passes 1/latency for latency)."""
        if score > 0:
            self.rows.append(features(choice, micro_batch))
            self.targets.append(math.log(score))
            self.weights = None

    def confident(self, choice: Choice, micro_batch: int) -> bool:
        row = features(choice, micro_batch)
        for j, value in enumerate(row[1:-1], start=1):  # the micro batch is always extrapolated
            seen = {r[j] for r in self.rows}
            ordinal = j in ORDINAL_FEATURES
            if value not in seen and not (ordinal and len(seen) >= 2):
                return False
        return len(self.rows) >= 2

    def well_below(self, choice: Choice, micro_batch: int, best: Optional[float]) -> bool:
        """Confident, and predicted more than ``MODEL_SKIP_MARGIN`` below ``best`` (a score:
        higher is better): what model_based leaves out, choices and micro batches alike."""
        if best is None or best <= 0 or not self.confident(choice, micro_batch):
            return False
        floor = math.log(best) + math.log(1.0 - MODEL_SKIP_MARGIN)
        return self.predict(choice, micro_batch) < floor

    def predict(self, choice: Choice, micro_batch: int) -> float:
        if not self.rows:
            return 0.0
        if self.weights is None:
            x = torch.tensor(self.rows, dtype=torch.float64)
            y = torch.tensor(self.targets, dtype=torch.float64)
            gram = x.T @ x + RIDGE * torch.eye(x.shape[1], dtype=torch.float64)
            self.weights = torch.linalg.solve(gram, x.T @ y)
        return float(torch.tensor(features(choice, micro_batch), dtype=torch.float64) @ self.weights)


class ChoiceOrder:
    """Hands out the choices one at a time in the tuner's order."""

    def __init__(self, choices: Sequence[Choice], tuner_type: str, model: CostModel,
                 largest_micro_batch: Callable[[Choice], int], seed: int = 0) -> None:
        self.pending = list(choices)
        if tuner_type == "random":
            random.Random(seed).shuffle(self.pending)
        self.tuner_type = tuner_type
        self.model = model
        self.largest = largest_micro_batch
        self.started = 0
        self.skipped: List[Choice] = []

    def next(self, best: Optional[float] = None) -> Optional[Choice]:
        """The next choice; ``best``: the best metric so far (higher is better), for skipping."""
        if self.tuner_type == "model_based" and self.started >= MODEL_WARMUP and self.model.rows:
            keep = [c for c in self.pending if not self.model.well_below(c, self.largest(c), best)]
            self.skipped += [c for c in self.pending if c not in keep]
            self.pending = keep
            if not self.pending:
                return None
            scores = [self.model.predict(c, self.largest(c)) for c in self.pending]
            index = max(range(len(scores)), key=scores.__getitem__)
        elif not self.pending:
            return None
        else:
            index = 0
        self.started += 1
        return self.pending.pop(index)

    def drop(self, keep: Callable[[Choice], bool]) -> None:
        """Forget pending choices that ``keep`` rejects."""
        self.pending = [c for c in self.pending if keep(c)]

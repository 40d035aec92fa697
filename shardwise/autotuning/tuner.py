"""Which experiment runs next: the micro batch search of one choice, and the order of choices.

* ``MicroBatchSearch``: for one choice, a binary search for the largest micro batch that
  runs (starting at the largest one the memory model lets through), then the next smaller
  candidates until ``num_tuning_micro_batch_sizes`` sizes have a metric.
* ``ChoiceOrder``: the order of choices. ``gridsearch``: the space's order; ``random``: a
  seeded shuffle; ``model_based``: after ``MODEL_WARMUP`` choices in grid order, the choice
  whose best predicted metric is highest under ``CostModel``.
* ``CostModel``: a ridge regression of log(metric) on one-hot features of a choice (stage,
  offload, checkpointing, compile) and log2(micro batch), fitted on the finished trials.
  Simple on purpose: a handful of trials is all it ever sees.
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


@dataclass
class MicroBatchSearch:
    """Binary search for the largest micro batch that runs, then a few smaller ones."""

    candidates: List[Experiment]
    """Ascending micro batch."""
    fits: Callable[[Experiment], bool]
    """The memory model's verdict (True when unknown)."""
    num_sizes: int = 3
    ok: Dict[int, bool] = field(default_factory=dict)
    """Index -> ran (True) or failed (False)."""

    def __post_init__(self) -> None:
        fitting = [i for i, e in enumerate(self.candidates) if self.fits(e)]
        self._lo = -1  # largest index known to run
        self._hi = (max(fitting) + 1) if fitting else 0  # smallest index known (or predicted) to fail
        self.pruned = len(self.candidates) - self._hi

    def next(self) -> Optional[Experiment]:
        """The next experiment of this choice, or None when it is done."""
        if self._hi - self._lo > 1:
            probe = self._hi - 1 if self._lo == -1 and not self.ok else (self._lo + self._hi + 1) // 2
            return self.candidates[probe]
        if self._lo < 0:
            return None
        measured = sum(1 for v in self.ok.values() if v)
        for i in range(self._lo - 1, -1, -1):
            if measured >= self.num_sizes:
                break
            if i not in self.ok:
                return self.candidates[i]
        return None

    def record(self, exp: Experiment, ran: bool) -> None:
        i = self.candidates.index(exp)
        self.ok[i] = ran
        if ran:
            self._lo = max(self._lo, i)
        elif i <= self._lo:
            pass  # a smaller size failed for another reason: keep the bounds
        else:
            self._hi = min(self._hi, i)


def features(choice: Choice, micro_batch: int) -> List[float]:
    return [1.0, *(float(choice.stage == s) for s in (1, 2, 3)),
            float(choice.offload_optimizer != "none"), float(choice.offload_param != "none"),
            float(choice.ac == "selective"), float(choice.ac == "full"), float(choice.compile),
            math.log2(micro_batch)]


class CostModel:
    """Ridge regression of log(metric) on ``features``; higher prediction = better."""

    def __init__(self, higher_is_better: bool = True) -> None:
        self.sign = 1.0 if higher_is_better else -1.0
        self.rows: List[List[float]] = []
        self.targets: List[float] = []
        self.weights: Optional[torch.Tensor] = None

    def add(self, choice: Choice, micro_batch: int, metric: float) -> None:
        if metric > 0:
            self.rows.append(features(choice, micro_batch))
            self.targets.append(self.sign * math.log(metric))
            self.weights = None

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

    def next(self) -> Optional[Choice]:
        if not self.pending:
            return None
        index = 0
        if self.tuner_type == "model_based" and self.started >= MODEL_WARMUP and self.model.rows:
            scores = [self.model.predict(c, self.largest(c)) for c in self.pending]
            index = max(range(len(scores)), key=scores.__getitem__)
        self.started += 1
        return self.pending.pop(index)

    def drop(self, keep: Callable[[Choice], bool]) -> None:
        """Forget pending choices that ``keep`` rejects."""
        self.pending = [c for c in self.pending if keep(c)]

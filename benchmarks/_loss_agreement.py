"""Do the variants of one benchmark run learn the same thing? The loss-agreement table.

Every variant trains the same weights on the same batches with the same optimizer settings,
so their per-step loss curves must agree within bf16 noise. A tokens/s ratio between two
variants whose curves part ways compares different computations, so the parent prints this
table next to the speed table and flags the rows that disagree.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

#: Variants preferred as the reference curve, in order (bf16 compute with fp32 master weights
#: and fp32 gradient accumulation, the setting every engine variant is configured to).
REFERENCE_ORDER = ("fsdp2", "sw_z2", "ds_z2", "torch", "ddp")

#: Largest |loss - reference loss| over the compared steps that still counts as bf16 noise.
DEFAULT_TOLERANCE = 0.05


@dataclass(frozen=True)
class LossAgreement:
    """One variant's curve against the reference curve over the first ``steps`` steps."""

    variant: str
    """The compared variant."""
    reference: str
    """The variant whose curve is the reference."""
    steps: int
    """Steps compared (the shorter of the two curves, capped at the requested count)."""
    loss_first: float
    """The variant's loss at step 1 (before any update: differs only by forward numerics)."""
    loss_last: float
    """The variant's loss at the last compared step."""
    max_abs_delta: float
    """max over the compared steps of |loss - reference loss|."""
    mean_abs_delta: float
    """mean over the compared steps of |loss - reference loss|."""
    agrees: bool
    """max_abs_delta <= tolerance and every compared loss is finite."""


def pick_reference(curves: dict[str, Sequence[float]], requested: str | None = None) -> str | None:
    """The reference variant: ``requested`` if it has a curve, else the first of
    REFERENCE_ORDER present, else the first variant with a curve; None when none has one."""
    if requested:
        if requested not in curves:
            raise ValueError(f"--loss-ref {requested!r} has no loss curve (variants with one: "
                             f"{', '.join(curves) or 'none'})")
        return requested
    for name in REFERENCE_ORDER:
        if name in curves:
            return name
    return next(iter(curves), None)


def compare_curves(variant: str, curve: Sequence[float], reference: str,
                   ref_curve: Sequence[float], steps: int,
                   tolerance: float = DEFAULT_TOLERANCE) -> LossAgreement:
    """Compare ``curve`` with ``ref_curve`` over their first ``min(steps, len(both))`` steps."""
    n = min(steps, len(curve), len(ref_curve))
    if n < 1:
        raise ValueError(f"{variant}: no common steps to compare with {reference} "
                         f"({len(curve)} vs {len(ref_curve)} losses)")
    deltas = [abs(a - b) for a, b in zip(curve[:n], ref_curve[:n])]
    finite = all(math.isfinite(x) for x in curve[:n])
    max_delta = max(deltas) if finite else math.inf
    return LossAgreement(variant=variant, reference=reference, steps=n,
                         loss_first=float(curve[0]), loss_last=float(curve[n - 1]),
                         max_abs_delta=max_delta, mean_abs_delta=sum(deltas) / n,
                         agrees=finite and max_delta <= tolerance)


def loss_agreement(results: Sequence[dict[str, Any]], steps: int, reference: str | None = None,
                   tolerance: float = DEFAULT_TOLERANCE) -> list[LossAgreement]:
    """One LossAgreement per result that has a ``loss_curve`` (errored rows are left out)."""
    curves = {r["variant"]: r["loss_curve"] for r in results
              if not r.get("error") and r.get("loss_curve")}
    ref = pick_reference(curves, reference)
    if ref is None:
        return []
    return [compare_curves(name, curve, ref, curves[ref], steps, tolerance)
            for name, curve in curves.items()]


def annotate(results: list[dict[str, Any]], rows: Sequence[LossAgreement]) -> None:
    """Copy each variant's max |Δloss| into its result row (the speed table shows it)."""
    by_name = {row.variant: row for row in rows}
    for r in results:
        row = by_name.get(r["variant"])
        if row is not None:
            r["loss_max_delta"] = row.max_abs_delta
            r["loss_agrees"] = row.agrees


def table_rows(rows: Sequence[LossAgreement]) -> list[dict[str, Any]]:
    """Rows for ``_common.format_table`` with AGREEMENT_COLUMNS."""
    return [{**asdict(row), "verdict": "ok" if row.agrees else "DIFFERS"} for row in rows]


AGREEMENT_COLUMNS = [
    ("variant", "variant", ""),
    ("reference", "reference", ""),
    ("steps", "steps", "d"),
    ("loss_first", "first loss", ".4f"),
    ("loss_last", "last loss", ".4f"),
    ("max_abs_delta", "max |Δloss|", ".4f"),
    ("mean_abs_delta", "mean |Δloss|", ".4f"),
    ("verdict", "agrees", ""),
]

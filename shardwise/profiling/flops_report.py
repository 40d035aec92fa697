"""The flops profiler's report, laid out as DeepSpeed's so existing greps and parsers work.

Three parts: the summary (params per GPU, fwd MACs/flops, latencies, FLOPS per GPU and,
where the accelerator's peak is known, MFU), the aggregated profile (top modules by
params / MACs / latency at each depth) and the detailed profile (the module tree with each
module's params, MACs, latency and FLOPS, in ``print(model)``'s shape).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional

from torch import nn

from .peak_flops import device_peak_flops

if TYPE_CHECKING:
    from .flops_profiler import FlopsProfiler

PRECISION = 2
LINE = "{:<70}  {:<8}"


# --- numbers as DeepSpeed prints them ----------------------------------------------------------
_MAGNITUDES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))
_UNIT_SCALE = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "m": 1e-3, "u": 1e-6, "": 1.0}


def number_to_string(num: float, units: Optional[str] = None, precision: int = PRECISION) -> str:
    """``1234567`` -> ``"1.23 M"`` (T, G, M, K, none, m, u)."""
    if units is None:
        units = ""
        for scale, unit in _MAGNITUDES:
            if num >= scale:
                units = unit
                break
        else:
            if not (num >= 1 or num == 0):
                units = "m" if num >= 1e-3 else "u"
    scale = _UNIT_SCALE.get(units, 1.0)
    return f"{round(num / scale, precision):g} {units}"


def macs_to_string(macs: float, units: Optional[str] = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: Optional[str] = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: Optional[str] = None, precision: int = PRECISION) -> str:
    """Parameters use B (billions) where the others use G: ``"1.1 B"``."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: Optional[str] = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


def _pct(part: float, total: float) -> str:
    return f"{round(100 * part / total, PRECISION) if total else 0:g}%"


@dataclass(frozen=True)
class ProfileTimes:
    """Engine-measured latencies of the profiled step, in seconds."""

    fwd: float
    """Forward of the profiled micro batch (the engine's call, hooks included)."""
    bwd: float
    """From the end of that forward to the start of ``engine.step()``: backward and its
    gradient reduction (and any loss code between the two calls)."""
    step: float
    """``engine.step()`` on the accumulation boundary: the optimizer step and its gathers."""


# --- summary -----------------------------------------------------------------------------------
def _engine_lines(engine) -> List[str]:
    return [LINE.format("world size: ", engine.world_size),
            LINE.format("data parallel size: ", engine.world_size),
            LINE.format("model parallel size: ", 1),
            LINE.format("batch size per GPU: ", engine.train_micro_batch_size_per_gpu())]


def _throughput_lines(flops: float, times: ProfileTimes, factor: float, engine) -> List[str]:
    bwd_factor = factor - 1
    iter_latency = times.fwd + times.bwd + times.step
    lines = [
        LINE.format("bwd latency: ", duration_to_string(times.bwd)),
        LINE.format(f"bwd FLOPS per GPU = {bwd_factor:g} * fwd flops per GPU / bwd latency: ",
                    flops_to_string(bwd_factor * flops / times.bwd if times.bwd else 0)),
        LINE.format(f"fwd+bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / (fwd+bwd latency): ",
                    flops_to_string(factor * flops / (times.fwd + times.bwd))),
        LINE.format("step latency: ", duration_to_string(times.step)),
        LINE.format("iter latency: ", duration_to_string(iter_latency)),
        LINE.format(f"FLOPS per GPU = {factor:g} * fwd flops per GPU / iter latency: ",
                    flops_to_string(factor * flops / iter_latency)),
    ]
    if engine is not None:
        samples = engine.train_micro_batch_size_per_gpu() * engine.world_size
        lines.append(LINE.format("samples/second: ", round(samples / iter_latency, PRECISION)))
    return lines


def _mfu_lines(achieved: float, label: str, device) -> List[str]:
    peak = device_peak_flops(device)
    if peak is None:
        return [LINE.format("accelerator peak FLOPS (bf16 dense): ",
                            "unknown (CPU or an unlisted device; set SHARDWISE_PEAK_TFLOPS)")]
    return [LINE.format("accelerator peak FLOPS (bf16 dense): ", flops_to_string(peak)),
            LINE.format(f"MFU = {label} / peak FLOPS: ", f"{100 * achieved / peak:.2f}%")]


def _summary(prof: "FlopsProfiler", profile_step: int, times: Optional[ProfileTimes]) -> List[str]:
    engine = prof.ds_engine
    flops, macs = prof.module_flops_macs(prof.model)
    params = prof.get_total_params()
    fwd = times.fwd if times is not None else prof.get_total_duration()
    lines = ["", "-------------------------- Shardwise Flops Profiler --------------------------",
             f"Profile Summary at step {profile_step}:",
             "Notations: params = parameters, MACs = multiply-accumulates, flops = floating-point",
             "operations, FLOPS = flops per second, dp/mp size = data/model parallel size,",
             "fwd/bwd latency = forward/backward time, step latency = optimizer step time,",
             "iter latency = fwd + bwd + step.", ""]
    if engine is not None:
        lines += _engine_lines(engine)
    lines += [LINE.format("params per GPU: ", params_to_string(params)),
              LINE.format("params of model = params per GPU * mp_size: ", params_to_string(params)),
              LINE.format("fwd MACs per GPU: ", macs_to_string(macs)),
              LINE.format("fwd flops per GPU: ", number_to_string(flops)),
              LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops)),
              LINE.format("fwd latency: ", duration_to_string(fwd)),
              LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
                          flops_to_string(flops / fwd if fwd else 0))]
    device = getattr(engine, "device", None) or _model_device(prof.model)
    if times is not None:
        factor = 3 + prof.recompute_fwd_factor
        lines += _throughput_lines(flops, times, factor, engine)
        iter_latency = times.fwd + times.bwd + times.step
        lines += _mfu_lines(3 * flops / iter_latency, "3 * fwd flops per GPU / iter latency", device)
    else:
        lines += _mfu_lines(flops / fwd if fwd else 0.0, "fwd FLOPS per GPU", device)
    return lines


def _model_device(model: nn.Module):
    first = next(model.parameters(), None)
    return first.device if first is not None else None


# --- aggregated profile ------------------------------------------------------------------------
def _top(rows: Dict[str, List[float]], column: int, fmt, k: int) -> Dict[str, str]:
    """The ``k`` classes with the largest ``column`` (0 MACs, 1 params, 2 latency), formatted."""
    ranked = sorted(rows.items(), key=lambda kv: kv[1][column], reverse=True)[:k]
    return {name: fmt(values[column]) for name, values in ranked}


def render_aggregated(prof: "FlopsProfiler", module_depth: int = -1, top_modules: int = 1) -> str:
    """Per depth, the ``top_modules`` module classes with the most params, MACs and latency."""
    info: Dict[int, Dict[str, List[float]]] = {}

    def walk(module: nn.Module, depth: int) -> None:
        row = info.setdefault(depth, {}).setdefault(type(module).__name__, [0, 0, 0.0])
        row[0] += prof.module_flops_macs(module)[1]
        row[1] += prof.module_profile(module).params
        row[2] += prof.module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(prof.model, 0)
    depths = len(info) if module_depth == -1 else min(module_depth, len(info))
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different "
             "model depths:"]
    for d in range(depths):
        lines += [f"depth {d}:",
                  f"    params      - {_top(info[d], 1, params_to_string, top_modules)}",
                  f"    MACs        - {_top(info[d], 0, macs_to_string, top_modules)}",
                  f"    fwd latency - {_top(info[d], 2, duration_to_string, top_modules)}"]
    return "\n".join(lines)


# --- detailed profile --------------------------------------------------------------------------
def _module_stats(prof: "FlopsProfiler", module: nn.Module, totals: tuple) -> str:
    total_params, total_macs, total_duration = totals
    params = prof.module_profile(module).params
    flops, macs = prof.module_flops_macs(module)
    duration = prof.module_duration(module)
    items = [f"{params_to_string(params)} = {_pct(params, total_params)} Params",
             f"{macs_to_string(macs)} = {_pct(macs, total_macs)} MACs",
             f"{duration_to_string(duration)} = {_pct(duration, total_duration)} latency",
             flops_to_string(round(flops / duration, PRECISION) if duration else 0)]
    extra = module.extra_repr()
    if extra:
        items.append(extra)
    return ", ".join(items)


def _tree(prof: "FlopsProfiler", module: nn.Module, totals: tuple) -> str:
    """``repr(module)`` with each module's profile where its extra_repr would be."""
    own = _module_stats(prof, module, totals).split("\n")
    children = []
    for name, child in module.named_children():
        body = _tree(prof, child, totals).replace("\n", "\n  ")
        children.append(f"({name}): {body}")
    text = type(module).__name__ + "("
    if len(own) == 1 and not children:
        return text + own[0] + ")"
    return text + "\n  " + "\n  ".join(own + children) + "\n)"


def render_profile(prof: "FlopsProfiler", profile_step: int = 1, module_depth: int = -1,
                   top_modules: int = 1, detailed: bool = True,
                   times: Optional[ProfileTimes] = None) -> str:
    """The whole report as one string."""
    lines = _summary(prof, profile_step, times)
    lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------",
              render_aggregated(prof, module_depth=module_depth, top_modules=top_modules)]
    if detailed:
        totals = (prof.get_total_params(), prof.get_total_macs(), prof.get_total_duration())
        lines += ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                  "Per module, after its name: params, % of all params, MACs, % of all MACs, "
                  "fwd latency, % of the model's fwd latency, fwd FLOPS.",
                  "",
                  "Notes: work a module does through functions rather than submodules (a loss, "
                  "an attention kernel) is part of that module's numbers but has no line of its "
                  "own, so a parent can exceed the sum of its children. Flop counts are "
                  "analytic, so FLOPS derived from them can exceed what the hardware sustains. "
                  "The top module's latency is its own forward call; the summary's fwd latency "
                  "is the engine's, which includes the engine's hooks.",
                  "",
                  _tree(prof, prof.model, totals)]
    lines.append("------------------------------------------------------------------------------")
    return "\n".join(lines) + "\n"

"""infer_bench's tables: the rows, the ratios the issue asks for, and its targets met or not."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from _child_run import same_point, tok_s_ratio

ORDER = ["hf_eager", "hf_static", "ds", "ds_inject", "sw_eager", "sw_inject", "sw_int8"]
LABELS = {"hf_eager": "HF eager", "hf_static": "HF static+compile", "ds": "DeepSpeed",
          "ds_inject": "DeepSpeed inject", "sw_eager": "shardwise eager",
          "sw_inject": "shardwise inject", "sw_int8": "shardwise int8 inject"}


def label(variant: str) -> str:
    """The table's name of a variant (``@OPTIONS`` kept after it)."""
    name, _, options = variant.partition("@")
    return LABELS[name] + (f" @{options}" if options else "")


def sorted_rows(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    order = {v: i for i, v in enumerate(ORDER)}
    size_order = {"tiny": 0, "1.1b": 1, "7b": 2}
    return sorted(rows, key=lambda r: (size_order.get(r["size"], 9), r["batch"],
                                       order.get(r["variant"].partition("@")[0], 99), r["variant"]))


def _fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def print_tables(rows: List[Dict[str, Any]]) -> None:
    rows = sorted_rows(rows)
    print(f"\n{'size':5} {'variant':34} {'B':>3} {'tok/s':>9} {'ms/tok':>8} {'HBM%':>6} "
          f"{'1st tok ms':>10} {'peak GiB':>8} {'cold s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['size']:5} {label(r['variant']):34} {r['batch']:>3} FAILED: {r['error']}")
            continue
        print(f"{r['size']:5} {label(r['variant']):34} {r['batch']:>3} {r['tok_s']:9.1f} "
              f"{r['ms_per_token']:8.2f} {_fmt(r.get('hbm_fraction'), '6.1f', 100)} "
              f"{r.get('first_token_ms', r['prefill_ms']):10.1f} {_fmt(r.get('peak_gib'), '8.1f')} "
              f"{r['cold_start_s']:7.1f}")
    print(f"\nratios (tokens/s): {'size':5} {'variant':34} {'B':>3} {'vs HF static':>12} "
          f"{'vs HF eager':>11} {'vs DeepSpeed':>12} {'vs sw inject':>12}")
    for r in rows:
        if "error" in r:
            continue
        print(f"                   {r['size']:5} {label(r['variant']):34} {r['batch']:>3} "
              f"{tok_s_ratio(rows, r, 'hf_static'):>12} {tok_s_ratio(rows, r, 'hf_eager'):>11} "
              f"{tok_s_ratio(rows, r, 'ds'):>12} {tok_s_ratio(rows, r, 'sw_inject'):>12}")
    print("(vs sw inject of the int8 row = int8 over our bf16; HBM% = sequence tokens/s over "
          "copy bandwidth / bf16 weight bytes; cold = build + engine + first generate)")
    options = sorted({(r["size"], r["variant"], r["decode"]) for r in rows if r.get("decode")})
    for size, variant, decode in options:
        print(f"{size} {label(variant)}: decode step with DecodeOptions {decode}")


def print_int8_accuracy(rows: List[Dict[str, Any]]) -> None:
    for r in rows:
        if "ppl_int8" in r:
            own = r.get("weight_bytes_own")
            note = f", weights {own / 1e9:.2f} GB vs {r['weight_bytes'] / 1e9:.2f} GB bf16" if own else ""
            print(f"int8 accuracy {r['size']} B={r['batch']}: perplexity on quant.FIXED_TEXT "
                  f"{r['ppl_bf16']:.3f} (bf16) -> {r['ppl_int8']:.3f} (int8), "
                  f"{100 * r['ppl_delta_rel']:+.3f}%{note}")


def _ratio(rows: List[Dict[str, Any]], size: str, batch: int, variant: str,
           other: str) -> Optional[float]:
    row = same_point(rows, {"size": size, "batch": batch}, variant)
    ref = same_point(rows, {"size": size, "batch": batch}, other)
    if not row or not ref or not row.get("tok_s") or not ref.get("tok_s"):
        return None
    return row["tok_s"] / ref["tok_s"]


def _value(rows: List[Dict[str, Any]], size: str, batch: int, variant: str, key: str) -> Optional[float]:
    row = same_point(rows, {"size": size, "batch": batch}, variant)
    return None if row is None else row.get(key)


def target_lines(rows: List[Dict[str, Any]]) -> List[str]:
    """The issue's targets, each with the measured value and met / NOT met / not measured."""
    checks = []
    for size, frac, vs_static in (("7b", 0.75, 1.5), ("1.1b", 0.40, 2.0)):
        checks.append((f"{size} inject B=1 HBM fraction >= {frac:.0%}",
                       _value(rows, size, 1, "sw_inject", "hbm_fraction"), frac, "{:.1%}"))
        checks.append((f"{size} inject B=1 vs HF static >= {vs_static}x",
                       _ratio(rows, size, 1, "sw_inject", "hf_static"), vs_static, "{:.2f}x"))
        for batch in (8, 32):
            checks.append((f"{size} inject B={batch} vs HF static >= 1.2x",
                           _ratio(rows, size, batch, "sw_inject", "hf_static"), 1.2, "{:.2f}x"))
        checks.append((f"{size} inject B=1 vs DeepSpeed >= 10x",
                       _ratio(rows, size, 1, "sw_inject", "ds"), 10.0, "{:.1f}x"))
    checks.append(("7b int8 B=1 vs our bf16 >= 1.6x", _ratio(rows, "7b", 1, "sw_int8", "sw_inject"),
                   1.6, "{:.2f}x"))
    lines = []
    for name, value, goal, spec in checks:
        verdict = "not measured" if value is None else ("met" if value >= goal else "NOT met")
        shown = "-" if value is None else spec.format(value)
        lines.append(f"{name:44} {shown:>8}  {verdict}")
    cold = _value(rows, "7b", 1, "sw_inject", "cold_start_s")
    first = _value(rows, "7b", 1, "sw_inject", "first_token_ms")
    verdict = "not measured" if cold is None else ("met" if cold <= 60 else "NOT met")
    lines.append(f"{'7b inject cold start <= 60 s':44} {_fmt(cold, '7.1f'):>8}  {verdict}"
                 + ("" if first is None else f" (first token {first:.1f} ms once warm)"))
    return lines


def print_targets(rows: List[Dict[str, Any]]) -> None:
    print("\ntargets (issue 20):")
    for line in target_lines(rows):
        print("  " + line)

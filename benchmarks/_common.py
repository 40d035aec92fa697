"""Shared harness for the training benchmarks: model, data, timing, FLOPs, memory, tables.

Everything here is framework-neutral: the variant code in ``train_bench.py`` builds an
engine around the model and hands the harness one callable that runs a whole optimizer step.
"""
from __future__ import annotations

import gc
import json
import os
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import sysconfig
from pathlib import Path

import psutil
import torch

GIB = 1024**3

# bf16 dense tensor-core peak of one H200 (SXM), in FLOP/s. The H200 has the H100's compute
# die, so its dense bf16 peak is the H100 SXM's 989 TFLOP/s (1979 is the sparse figure).
H200_BF16_DENSE_PEAK_FLOPS = 989e12


@dataclass
class BenchConfig:
    """Sizes and loop lengths shared by every variant of one run."""

    layers: int = 22
    """Decoder layers (LlamaConfig.num_hidden_layers)."""
    hidden: int = 2048
    """Model width (LlamaConfig.hidden_size)."""
    intermediate: int = 5632
    """MLP inner width (LlamaConfig.intermediate_size)."""
    heads: int = 32
    """Attention query heads."""
    kv_heads: int = 4
    """Key/value heads (grouped-query attention)."""
    vocab: int = 32000
    """Vocabulary size; random token ids are drawn from it."""
    seq: int = 2048
    """Tokens per sequence."""
    micro_batch: int = 8
    """Sequences per micro batch."""
    grad_accum: int = 1
    """Micro batches per optimizer step."""
    warmup: int = 3
    """Optimizer steps run before timing starts (allocator, autotuning, JIT, lazy state)."""
    steps: int = 10
    """Timed optimizer steps."""
    device: str = "cuda"
    """'cuda' or 'cpu'. CPU exists so the script can be smoke-tested without a GPU."""
    peak_flops: float = H200_BF16_DENSE_PEAK_FLOPS
    """Peak FLOP/s that MFU is measured against."""
    lr: float = 1e-4
    """AdamW learning rate for every variant."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas for every variant (DeepSpeed's FusedAdam and torch's AdamW default)."""
    adam_eps: float = 1e-8
    """AdamW epsilon for every variant (both libraries' default, set explicitly anyway)."""
    weight_decay: float = 0.0
    """Decoupled weight decay for every variant. Set explicitly because the defaults differ:
    torch.optim.AdamW decays by 0.01, DeepSpeed's FusedAdam (its "AdamW") by 0."""
    grad_clip: float = 0.0
    """Global-norm gradient clipping for every variant; 0 = none. Set explicitly because
    DeepSpeed >= 0.19.6 clips at 1.0 when the config says nothing, torch/FSDP2 never do."""
    seed: int = 1234
    """Seed for the weights and the token ids, so every variant sees the same problem."""
    nproc: int = 1
    """Processes (one per GPU) started through the ``shardwise`` launcher; tokens/s is per GPU,
    each rank trains on its own micro batches (the same batch per GPU at every world size)."""

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq * self.grad_accum

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BenchConfig":
        data = json.loads(text)
        if "betas" in data:  # JSON has no tuples
            data["betas"] = tuple(data["betas"])
        return cls(**data)


def add_shape_args(parser: Any, *, layers: bool = True, **defaults: int) -> None:
    """The model and batch shape flags the benchmarks share (``--hidden``, ``--kv-heads``, ...),
    defaulting to BenchConfig's 1.1B Llama unless ``defaults`` says otherwise."""
    d = BenchConfig()
    shape = {"layers": d.layers, "hidden": d.hidden, "intermediate": d.intermediate,
             "heads": d.heads, "kv_heads": d.kv_heads, "vocab": d.vocab, "seq": d.seq,
             "micro_batch": d.micro_batch, **defaults}
    if not layers:
        shape.pop("layers")
    for name, value in shape.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=value)


def llama_config(cfg: BenchConfig) -> Any:
    """The transformers LlamaConfig of ``cfg`` (SDPA attention, no KV cache)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        intermediate_size=cfg.intermediate,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        vocab_size=cfg.vocab,
        max_position_embeddings=max(cfg.seq, 2048),
        use_cache=False,  # training: a KV cache would only cost memory
        attn_implementation="sdpa",
    )


def build_model(cfg: BenchConfig, device: torch.device) -> torch.nn.Module:
    """A randomly initialised Llama-shaped causal LM in fp32 on ``device`` (no hub access).

    Building directly on the device keeps the 1.1B init fast; variants that offload move
    parameters to the host themselves, and setup memory is kept apart from training memory.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(cfg))
    model.train()
    return model


def make_batches(cfg: BenchConfig, device: torch.device) -> list[torch.Tensor]:
    """``grad_accum`` distinct micro batches of random ids, made once so timing excludes RNG."""
    rank = int(os.environ.get("RANK", "0"))
    gen = torch.Generator().manual_seed(cfg.seed + 1 + 1000 * rank)
    return [
        torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq), generator=gen).to(device)
        for _ in range(cfg.grad_accum)
    ]


def count_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once). Works before any sharding wrapper."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def embedding_params(model: torch.nn.Module) -> int:
    """Parameters of the input embedding table, which is a lookup and does no matmul."""
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    if out is not None and out.weight is emb.weight:
        return 0  # tied: the table is also the LM head, whose matmul is real work
    return emb.weight.numel()


def flops_per_token(cfg: BenchConfig, n_params: int, n_embedding: int) -> float:
    """Model FLOPs for one token of forward + backward (no recompute counted).

    Formula (PaLM, Chowdhery et al. 2022, appendix B):
        flops/token = 6 * N + 12 * L * h * s
    N   = parameters that take part in a matmul = all parameters minus the input embedding
          table (the LM head counts); 6 = 2 (multiply-add) * 3 (forward + two backward GEMMs).
    12 * L * h * s = attention scores QK^T and the weighted sum AV: 2 matmuls * 2 FLOPs *
          s * h per token per layer forward, times 3 for forward + backward. Counted over the
          full s x s matrix, not halved for the causal mask, as PaLM/Megatron MFU does.
    """
    n_matmul = n_params - n_embedding
    return 6.0 * n_matmul + 12.0 * cfg.layers * cfg.hidden * cfg.seq


class HostRssSampler:
    """Peak resident set size of this process, sampled on a thread.

    psutil gives only the current RSS on Linux/macOS (Windows has ``peak_wset``), so a
    10 ms sampler catches spikes during the offloaded optimizer step well enough.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        self._proc = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.peak_bytes = self._proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)
            self._stop.wait(self._interval_s)

    def __enter__(self) -> "HostRssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Measurement:
    """What one variant measured. Times in seconds, memory in GiB."""

    step_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    warmup_losses: list[float] = field(default_factory=list)
    """Losses of the untimed warm-up steps; with ``losses`` the curve from the first step."""
    gpu_peak_gib: float | None = None
    setup_gpu_peak_gib: float | None = None
    host_rss_peak_gib: float | None = None
    setup_s: float = 0.0
    gc_pause_s: list[float] = field(default_factory=list)
    """Per timed step, seconds the Python garbage collector ran: tells a GC pause from the GPU."""


class _GcClock:
    """Adds up the time Python's garbage collector runs, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start

    def __enter__(self) -> "_GcClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def measure(
    step: Callable[[], torch.Tensor],
    cfg: BenchConfig,
    device: torch.device,
    setup_s: float,
) -> Measurement:
    """Run ``warmup`` then ``steps`` optimizer steps; ``step`` returns the last loss.

    Each step ends with a device synchronize so the per-step times are real; one sync per
    step of ~1 s costs far less than the timing noise. Peak GPU memory is reset after setup,
    so it measures training (warm-up included), and the setup peak is kept beside it.
    """
    result = Measurement(setup_s=setup_s)
    if device.type == "cuda":
        result.setup_gpu_peak_gib = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    with HostRssSampler() as rss, _GcClock() as gc_clock:
        for _ in range(cfg.warmup):
            result.warmup_losses.append(float(step().detach().float().item()))
        synchronize(device)
        for _ in range(cfg.steps):
            gc_before = gc_clock.total
            start = time.perf_counter()
            loss = step()
            synchronize(device)
            result.step_times.append(time.perf_counter() - start)
            result.gc_pause_s.append(gc_clock.total - gc_before)
            result.losses.append(float(loss.detach().float().item()))
    result.host_rss_peak_gib = rss.peak_bytes / GIB
    if device.type == "cuda":
        result.gpu_peak_gib = torch.cuda.max_memory_allocated(device) / GIB
    return result


def summarize(m: Measurement, cfg: BenchConfig, flops_tok: float) -> dict[str, Any]:
    """Throughput numbers from a measurement: tokens/s over all timed steps, mean step time."""
    total = sum(m.step_times)
    tokens = cfg.tokens_per_step * len(m.step_times)
    tok_s = tokens / total if total > 0 else float("nan")
    return {
        "tokens_per_s": tok_s,
        "step_s": total / len(m.step_times) if m.step_times else float("nan"),
        "step_s_min": min(m.step_times) if m.step_times else float("nan"),
        "step_s_max": max(m.step_times) if m.step_times else float("nan"),
        # the median is blind to a one-off pause; tokens_per_s (the mean) is what is reported
        "step_s_median": statistics.median(m.step_times) if m.step_times else float("nan"),
        "mfu": tok_s * flops_tok / cfg.peak_flops,
        "gpu_peak_gib": m.gpu_peak_gib,
        "setup_gpu_peak_gib": m.setup_gpu_peak_gib,
        "host_rss_peak_gib": m.host_rss_peak_gib,
        "setup_s": m.setup_s,
        "loss_first": m.losses[0] if m.losses else None,
        "loss_last": m.losses[-1] if m.losses else None,
        # one loss per optimizer step from the very first (warm-up included): the curve the
        # loss-agreement table compares between variants
        "loss_curve": m.warmup_losses + m.losses,
        "step_times": m.step_times,
        "gc_pause_s": m.gc_pause_s,
    }


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0 or math.isnan(reference):
        return None
    return value / reference


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Plain-text table. ``columns`` holds (key, header, format spec); '' spec means str().

    A row with an ``error`` shows its last line after the variant name instead of numbers, so
    a failing variant stays visible without breaking the columns of the others.
    """
    headers = [h for _, h, _ in columns]
    ok_rows = [row for row in rows if not row.get("error")]
    cells_of = {
        id(row): [str(row.get(key, "")) if not spec else _fmt(row.get(key), spec)
                  for key, _, spec in columns]
        for row in ok_rows
    }
    names = [str(row.get(columns[0][0], "")) for row in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells_of.values()]) for i, h in enumerate(headers)]
    widths[0] = max([widths[0]] + [len(n) for n in names])
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    for name, row in zip(names, rows):
        if row.get("error"):
            # One line of the error in the row itself; the full text is in the JSON.
            first = str(row["error"]).strip().splitlines()[-1] if str(row["error"]).strip() else "?"
            out.append(f"{name.ljust(widths[0])}  FAILED: {first[:160]}")
            continue
        cells = cells_of[id(row)]
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))))
    return "\n".join(out)


def stdlib_corpus(max_bytes: int = 64 << 20) -> torch.Tensor:
    """The standard library's .py files (sorted paths, so the same bytes everywhere) as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1 << 20:
        raise SystemExit(f"the standard library under {root} gave only {total} bytes of source")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

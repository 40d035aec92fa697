"""Single-GPU training throughput: plain PyTorch, FSDP2, DeepSpeed and shardwise, in one run.

Every variant trains the same randomly initialised Llama-shaped model (~1.1B by default) on
the same random token ids, each in its own subprocess so that allocator state, pinned host
memory and process groups never leak from one variant into the next. The parent collects one
JSON line per variant, prints a table last and writes everything to ``--out``.

    python benchmarks/train_bench.py                                  # all variants, 1.1B, GPU
    python benchmarks/train_bench.py --variants torch,fsdp2,sw_z2 --grad-accum 4
    python benchmarks/train_bench.py --variants fsdp2_compile,ds_z2_compile,sw_z2_compile --timeout 900
    python benchmarks/train_bench.py --grad-accum 4 --warmup 2 --steps 3 --timeout 240 \
        --variants fsdp2,fsdp2_compile,ds_z2,ds_z2_compile,sw_z2,sw_z2_compile,sw_z3,sw_z3_compile,sw_z3_offload_dpu,sw_z3_offload_dpu_compile
    python benchmarks/train_bench.py --device cpu --layers 2 --hidden 64 --intermediate 128 \
        --heads 4 --kv-heads 2 --vocab 256 --seq 64 --micro-batch 2 --steps 2 --warmup 1

A variant that fails (an unsupported stage, a JIT build that breaks, a timeout) gets its error
in its table row and the run goes on.

The ``*_compile`` variants torch.compile the model (``--compile-backend``, inductor by
default): FSDP2 and shardwise compile each decoder layer (torchtitan's recipe; shardwise
through its ``compile`` config section), DeepSpeed compiles the whole model with
``engine.compile()`` (what DeepSpeed offers), and ``sw_z2_compile_module`` does the same in
shardwise for the like-for-like comparison. ``sw_z3_compile`` and ``sw_z3_offload_dpu_compile``
compile ZeRO-3 with ``"compile": {"deepcompile": true}`` (each layer compiled, the gathers and
reduce-scatters around it). A compiled row's "x eager" is its tokens/s over its uncompiled
twin's, "x fsdp2_c" over ``fsdp2_compile``'s. Compiling happens in the first warm-up step, so
the timed steps exclude it; give ``--timeout`` room for it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Callable

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
# The benchmark runs from a checkout, not an installed package: make the checkout's shardwise
# importable here and in every worker (workers get it through PYTHONPATH, see _worker_env).
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402

from _loss_agreement import (  # noqa: E402
    AGREEMENT_COLUMNS,
    DEFAULT_TOLERANCE,
    annotate,
    loss_agreement,
    table_rows,
)
from _common import (  # noqa: E402
    BenchConfig,
    add_shape_args,
    build_model,
    count_params,
    embedding_params,
    flops_per_token,
    format_table,
    make_batches,
    measure,
    ratio,
    summarize,
)

RESULT_MARKER = "@@TRAIN_BENCH_RESULT@@ "

StepFn = Callable[[], torch.Tensor]

# ---------------------------------------------------------------------------------------------
# ZeRO sections shared by the DeepSpeed and shardwise variants (same keys, same meaning).
# ---------------------------------------------------------------------------------------------
_OFFLOAD = {"device": "cpu", "pin_memory": True}
_NVME = {"device": "nvme", "pin_memory": True, "buffer_count": 4}

ZERO_SECTIONS: dict[str, dict[str, Any]] = {
    "z0": {"stage": 0},
    "z1": {"stage": 1},
    "z2": {"stage": 2},
    "z2_offload": {"stage": 2, "offload_optimizer": dict(_OFFLOAD)},
    "z2_offload_dpu": {"stage": 2, "offload_optimizer": {**_OFFLOAD, "delayed_update": True}},
    # "_top": top-level keys that go with the section (here: bf16 gradient accumulation)
    "z2_offload_bf16acc": {"stage": 2, "offload_optimizer": dict(_OFFLOAD),
                           "_top": {"data_types": {"grad_accum_dtype": "bf16"}}},
    "z3": {"stage": 3},
    "z3_offload": {"stage": 3, "offload_param": dict(_OFFLOAD),
                   "offload_optimizer": dict(_OFFLOAD)},
    "z3_offload_dpu": {"stage": 3, "offload_param": dict(_OFFLOAD),
                       "offload_optimizer": {**_OFFLOAD, "delayed_update": True}},
    # optimizer states on NVMe (ZeRO-Infinity): nvme_path comes from --nvme-path (nvme_zero());
    # sub-groups of 1e8 elements (DeepSpeed's default 1e9 is one 12 GB sub-group per buffer)
    "z2_nvme": {"stage": 2, "offload_optimizer": dict(_NVME)},
    "z3_nvme": {"stage": 3, "sub_group_size": 100_000_000, "offload_param": dict(_OFFLOAD),
                "offload_optimizer": dict(_NVME)},
}

# Which DeepSpeed variant each shardwise variant is compared with in the "x ds" column.
MATCHING_DS = {
    "sw_z2": "ds_z2",
    "sw_z2_offload": "ds_z2_offload",
    "sw_z2_offload_dpu": "ds_z2_offload",
    "sw_z2_offload_bf16acc": "ds_z2_offload",
    "sw_z1": "ds_z1",
    "sw_z3": "ds_z3",
    "sw_z3_offload": "ds_z3_offload",
    "sw_z3_offload_dpu": "ds_z3_offload",
    "sw_z3_nvme": "ds_z3_nvme",
    "sw_z2_compile": "ds_z2_compile",
    "sw_z2_compile_module": "ds_z2_compile",
    "sw_z3_compile": "ds_z3",
    "sw_z3_offload_dpu_compile": "ds_z3_offload",
    "sw_z2_monitors": "ds_z2",
    "sw_z2_wallclock": "ds_z2",
}

#: Environment variable that carries --compile-backend from the parent to the workers.
COMPILE_BACKEND_ENV = "TRAIN_BENCH_COMPILE_BACKEND"


#: Environment variable that carries --nvme-path from the parent to the workers.
NVME_PATH_ENV = "TRAIN_BENCH_NVME_PATH"


def nvme_zero(zero: dict[str, Any]) -> dict[str, Any]:
    """``zero`` with ``nvme_path`` filled in where a section offloads to NVMe."""
    out = dict(zero)
    for key in ("offload_optimizer", "offload_param"):
        section = out.get(key)
        if isinstance(section, dict) and section.get("device") == "nvme":
            out[key] = {**section, "nvme_path": os.environ.get(NVME_PATH_ENV)
                        or tempfile.gettempdir()}
    return out


def deepspeed_aio_error() -> str | None:
    """None when DeepSpeed's async_io op (which its NVMe offload needs) loads, else why not,
    in DeepSpeed's own words (it needs libaio, which a machine may not have)."""
    import io

    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    said = io.StringIO()
    # stdout only: DeepSpeed's probe compile redirects the stderr *file descriptor*
    # (sys.stderr.fileno()), which a StringIO in its place does not have, and its blanket
    # except then answers "not compatible" on a machine that has libaio
    with contextlib.redirect_stdout(said):
        compatible = builder.is_compatible(verbose=True)
    if not compatible:
        return ("DeepSpeed's async_io op is not compatible here (AsyncIOBuilder().is_compatible() "
                f"is False): {' '.join(said.getvalue().split())[-600:]}")
    try:
        builder.load()
    except Exception as exc:  # the JIT build: report its error, do not crash the run
        return f"AsyncIOBuilder().load() failed: {type(exc).__name__}: {exc}"
    return None


def compile_backend() -> str:
    """The torch.compile backend of the *_compile variants (inductor unless the parent says)."""
    return os.environ.get(COMPILE_BACKEND_ENV) or "inductor"


def round_weights_to_bf16(model: torch.nn.Module) -> None:
    """Make every fp32 weight exactly bf16-representable, in place.

    DeepSpeed and shardwise cast the model to bf16 and build their fp32 masters from that
    (so they start from bf16-rounded weights); FSDP2 and plain torch keep the fp32 init as
    master. Rounding first gives every variant the same starting point bit for bit."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.float32:
                p.copy_(p.to(torch.bfloat16))


def fp32_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the model's fp32 buffers (the rotary embedding's ``inv_freq``), by name."""
    return {n: b.detach().clone() for n, b in model.named_buffers() if b.dtype == torch.float32}


def restore_fp32_buffers(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> list[str]:
    """Put back the fp32 buffers an engine cast to bf16; returns their names.

    DeepSpeed (``module.bfloat16()``) and shardwise (``model.to(bf16)``) cast buffers with
    the parameters, FSDP2 and autocast do not. A bf16 ``inv_freq`` shifts RoPE angles by up to
    ~0.9 rad at position 2047 (head dim 64), a different forward from step 1 on; every variant
    gets the fp32 buffers so that all of them compute the same function."""
    restored = []
    for name, buffer in list(model.named_buffers()):
        if name in saved and buffer.dtype != torch.float32:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            owner._buffers[attr] = saved[name].to(buffer.device)
            restored.append(name)
    return restored


def _compile_check(compiled: bool, what: str) -> None:
    """A *_compile row must not silently measure the eager model."""
    if not compiled:
        raise RuntimeError(f"{what}: the model was not compiled (see the warning above); "
                           f"this row would measure eager code")


def adamw_kwargs(cfg: BenchConfig) -> dict[str, Any]:
    """The AdamW hyperparameters of every variant, spelled out: the libraries' defaults differ
    (torch's AdamW decays weights by 0.01, DeepSpeed's FusedAdam by 0)."""
    return {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.adam_eps,
            "weight_decay": cfg.weight_decay}


def clip_gradients(model: torch.nn.Module, cfg: BenchConfig) -> None:
    """Global-norm clipping for the hand-written loops, as the engines do for gradient_clipping."""
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)


def engine_config(cfg: BenchConfig, zero: dict[str, Any]) -> dict[str, Any]:
    """A ds_config dict: bf16, AdamW, the run's micro batch and accumulation, one ZeRO stage.

    Everything that decides what is learned is explicit, because DeepSpeed's and shardwise's
    defaults differ: gradient_clipping (DeepSpeed >= 0.19.6 clips at 1.0 unless told, shardwise
    at 0), AdamW's weight decay / eps / betas / bias correction, and the gradient accumulation
    dtype (DeepSpeed accumulates bf16 gradients in bf16 by default, shardwise and FSDP2 in fp32).
    """
    zero = dict(zero)
    top = zero.pop("_top", {})
    return {
        "data_types": {"grad_accum_dtype": "fp32"},
        **top,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {**adamw_kwargs(cfg), "betas": list(cfg.betas)}},
        "zero_optimization": zero,
        # The table is the output; per-step log lines would only bury it.
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


# ---------------------------------------------------------------------------------------------
# Process group for one process: FSDP2, DeepSpeed and shardwise all want one, even alone.
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_single_process_env() -> None:
    """The env a launcher would set for rank 0 of 1 (kept if the parent already set it)."""
    defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# ---------------------------------------------------------------------------------------------
# Variants. Each takes the built model and batches and returns a callable that runs one
# optimizer step (all grad_accum micro batches) and returns the last micro batch's loss.
# ---------------------------------------------------------------------------------------------
def _autocast_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                   batches: list[torch.Tensor], cfg: BenchConfig, device: torch.device,
                   sync_context: Callable[[bool], Any]) -> StepFn:
    """fp32 parameters under bf16 autocast; ``sync_context(last)`` wraps each micro batch."""
    def step() -> torch.Tensor:
        for i, x in enumerate(batches):
            with sync_context(i == len(batches) - 1):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss
                (loss / len(batches)).backward()
        clip_gradients(model, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def setup_torch(model: torch.nn.Module, batches: list[torch.Tensor], cfg: BenchConfig,
                device: torch.device) -> StepFn:
    """Plain PyTorch: fp32 parameters, bf16 autocast, fused AdamW."""
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(cfg), fused=True)
    return _autocast_step(model, opt, batches, cfg, device, lambda last: contextlib.nullcontext())


def setup_ddp(model: torch.nn.Module, batches: list[torch.Tensor], cfg: BenchConfig,
              device: torch.device) -> StepFn:
    """DistributedDataParallel (the stage-0 baseline): fp32 params, bf16 autocast, fused AdamW."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    set_single_process_env()
    dist.init_process_group(backend_for(device))
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(cfg), fused=True)
    # gradients are all-reduced on the last micro batch only
    return _autocast_step(ddp, opt, batches, cfg, device,
                          lambda last: contextlib.nullcontext() if last else ddp.no_sync())


def _setup_fsdp2(model: torch.nn.Module, batches: list[torch.Tensor], cfg: BenchConfig,
                 device: torch.device, offload: bool) -> StepFn:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)

    set_single_process_env()
    dist.init_process_group(backend_for(device))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    # One FSDP unit per decoder layer plus the root (embeddings, norm, head): the usual wrap.
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(cfg), fused=True)

    def step() -> torch.Tensor:
        for i, x in enumerate(batches):
            # FSDP2's own accumulation idiom: reduce gradients only on the last micro batch
            # (unsharded gradients accumulate in reduce_dtype, fp32, in between).
            model.set_requires_gradient_sync(i == len(batches) - 1)
            loss = model(input_ids=x, labels=x).loss
            (loss / len(batches)).backward()
        clip_gradients(model, cfg)  # DTensor gradients: clip_grad_norm_ reduces the norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def setup_fsdp2_compile(model, batches, cfg, device) -> StepFn:
    """FSDP2 as ``fsdp2`` with each decoder layer compiled first (torchtitan's order), in place."""
    for layer in model.model.layers:
        layer.compile(backend=compile_backend())
    return _setup_fsdp2(model, batches, cfg, device, offload=False)


def setup_fsdp2(model, batches, cfg, device) -> StepFn:
    """FSDP2 fully_shard on a world of 1, bf16 params / fp32 reduce, fused AdamW."""
    return _setup_fsdp2(model, batches, cfg, device, offload=False)


def setup_fsdp2_offload(model, batches, cfg, device) -> StepFn:
    """FSDP2 with CPUOffloadPolicy: sharded params, grads and AdamW state live on the host."""
    return _setup_fsdp2(model, batches, cfg, device, offload=True)


def engine_step(engine: Any, batches: list[torch.Tensor]) -> StepFn:
    """The DeepSpeed loop, also used for shardwise: the engine counts micro batches itself."""

    def step() -> torch.Tensor:
        for x in batches:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        return loss

    return step


def _setup_deepspeed(model, batches, cfg, device, zero_key: str) -> StepFn:
    import deepspeed

    if "nvme" in zero_key:
        problem = deepspeed_aio_error()
        if problem is not None:
            raise RuntimeError(problem)
    set_single_process_env()
    deepspeed.init_distributed(dist_backend=backend_for(device))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=engine_config(cfg, nvme_zero(ZERO_SECTIONS[zero_key])))
    return engine_step(engine, batches)


def _setup_shardwise(model, batches, cfg, device, zero_key: str) -> StepFn:
    import shardwise

    set_single_process_env()
    engine, _, _, _ = shardwise.initialize(model=model,
                                           config=engine_config(cfg, nvme_zero(ZERO_SECTIONS[zero_key])))
    return engine_step(engine, batches)


def setup_ds_z2_compile(model, batches, cfg, device) -> StepFn:
    """DeepSpeed ZeRO-2 as ``ds_z2``, then ``engine.compile()`` (the whole model)."""
    import deepspeed

    set_single_process_env()
    deepspeed.init_distributed(dist_backend=backend_for(device))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=engine_config(cfg, ZERO_SECTIONS["z2"]))
    engine.compile(backend=compile_backend())
    _compile_check(bool(engine.is_compiled), "ds_z2_compile")
    return engine_step(engine, batches)


#: The ``fp8`` section of the *_fp8 variants (torchao float8 training, tensorwise scaling).
FP8_SECTION = {"enabled": True, "recipe": "tensorwise"}


def _setup_shardwise_compile(model, batches, cfg, device, granularity: str,
                             fp8: bool = False, zero_key: str = "z2") -> StepFn:
    import shardwise

    set_single_process_env()
    config = engine_config(cfg, ZERO_SECTIONS[zero_key])
    config["compile"] = {"enabled": True, "backend": compile_backend(), "granularity": granularity}
    if zero_key.startswith("z3"):  # DeepSpeed's key for compiled ZeRO-3 (same effect here)
        config["compile"] = {"deepcompile": True, "backend": compile_backend()}
    if fp8:
        config["fp8"] = dict(FP8_SECTION)
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    _compile_check(engine.is_compiled, f"shardwise compile ({granularity})")
    return engine_step(engine, batches)


def setup_sw_z2_compile(model, batches, cfg, device) -> StepFn:
    """shardwise ZeRO-2 with "compile": {"enabled": true}: each decoder layer compiled."""
    return _setup_shardwise_compile(model, batches, cfg, device, "blocks")


def setup_sw_z3_compile(model, batches, cfg, device) -> StepFn:
    """shardwise ZeRO-3 with "compile": {"deepcompile": true}: each decoder layer compiled, the
    stage-3 gathers, prefetches and reduce-scatters around the compiled layers."""
    return _setup_shardwise_compile(model, batches, cfg, device, "blocks", zero_key="z3")


def setup_sw_z3_offload_dpu_compile(model, batches, cfg, device) -> StepFn:
    """``sw_z3_offload_dpu`` (parameters and optimizer on the host, delayed update) compiled
    like ``sw_z3_compile``."""
    return _setup_shardwise_compile(model, batches, cfg, device, "blocks",
                                    zero_key="z3_offload_dpu")


def setup_sw_z2_compile_module(model, batches, cfg, device) -> StepFn:
    """shardwise ZeRO-2 compiling the whole model (granularity "module"), like DeepSpeed."""
    return _setup_shardwise_compile(model, batches, cfg, device, "module")


def monitor_output_path() -> Path:
    """Where the monitor variants write their CSV runs: $OUT/monitors (else out/monitors)."""
    out = os.environ.get("OUT")
    return (Path(out) if out else REPO_ROOT / "out") / "monitors"


def _setup_shardwise_monitors(model, batches, cfg, device, wall_clock: bool) -> StepFn:
    """``sw_z2`` with the CSV monitor on and DeepSpeed's default steps_per_print (10): every
    step's events, a log line, a flush and a host read every 10 steps. Its job folder is
    ``monitor_output_path()/<variant>``, ready for ``shardwise plot``."""
    import shardwise

    set_single_process_env()
    name = "sw_z2_wallclock" if wall_clock else "sw_z2_monitors"
    root = monitor_output_path()
    job, k = name, 1
    while (root / job).exists():  # a variant listed twice gets a run folder per repeat
        k += 1
        job = f"{name}_{k}"
    config = engine_config(cfg, ZERO_SECTIONS["z2"])
    config.update(steps_per_print=10, wall_clock_breakdown=wall_clock,
                  csv_monitor={"enabled": True, "output_path": str(root), "job_name": job})
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    return engine_step(engine, batches)


def setup_sw_z2_fp8(model, batches, cfg, device) -> StepFn:
    """shardwise ZeRO-2 with "fp8": decoder linears in FP8 (torchao), eager."""
    import shardwise

    set_single_process_env()
    config = {**engine_config(cfg, ZERO_SECTIONS["z2"]), "fp8": dict(FP8_SECTION)}
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    return engine_step(engine, batches)


def setup_sw_z2_monitors(model, batches, cfg, device) -> StepFn:
    """shardwise ZeRO-2 with the CSV monitor (loss, lr, grad norm, throughput, memory)."""
    return _setup_shardwise_monitors(model, batches, cfg, device, wall_clock=False)


def setup_sw_z2_wallclock(model, batches, cfg, device) -> StepFn:
    """sw_z2_monitors plus wall_clock_breakdown (syncs around every phase: slower by design)."""
    return _setup_shardwise_monitors(model, batches, cfg, device, wall_clock=True)


def setup_sw_z2_compile_fp8(model, batches, cfg, device) -> StepFn:
    """shardwise ZeRO-2, decoder layers compiled, linears in FP8 (FP8's intended setting)."""
    return _setup_shardwise_compile(model, batches, cfg, device, "blocks", fp8=True)


def setup_sw_z3_compile_fp8(model, batches, cfg, device) -> StepFn:
    """``sw_z3_compile`` with the decoder linears in FP8: ZeRO-3 gathers the bf16 shards,
    Float8Linear casts inside each compiled layer."""
    return _setup_shardwise_compile(model, batches, cfg, device, "blocks", fp8=True, zero_key="z3")


def _bind(setup: Callable[..., StepFn], zero_key: str) -> Callable[..., StepFn]:
    def bound(model, batches, cfg, device) -> StepFn:
        return setup(model, batches, cfg, device, zero_key)

    bound.__doc__ = f"{setup.__name__.removeprefix('_setup_')} with zero_optimization " \
                    f"{json.dumps(ZERO_SECTIONS[zero_key])}"
    return bound


VARIANTS: dict[str, Callable[..., StepFn]] = {
    "torch": setup_torch,
    "ddp": setup_ddp,
    "fsdp2": setup_fsdp2,
    "fsdp2_offload": setup_fsdp2_offload,
    "ds_z2": _bind(_setup_deepspeed, "z2"),
    "ds_z2_offload": _bind(_setup_deepspeed, "z2_offload"),
    "ds_z3": _bind(_setup_deepspeed, "z3"),
    "ds_z3_offload": _bind(_setup_deepspeed, "z3_offload"),
    "sw_z0": _bind(_setup_shardwise, "z0"),
    "sw_z1": _bind(_setup_shardwise, "z1"),
    "sw_z2": _bind(_setup_shardwise, "z2"),
    "sw_z2_offload": _bind(_setup_shardwise, "z2_offload"),
    "sw_z2_offload_dpu": _bind(_setup_shardwise, "z2_offload_dpu"),
    "sw_z2_offload_bf16acc": _bind(_setup_shardwise, "z2_offload_bf16acc"),
    "sw_z3": _bind(_setup_shardwise, "z3"),
    "ds_z1": _bind(_setup_deepspeed, "z1"),
    "sw_z3_offload": _bind(_setup_shardwise, "z3_offload"),
    "sw_z3_offload_dpu": _bind(_setup_shardwise, "z3_offload_dpu"),
    "sw_z2_nvme": _bind(_setup_shardwise, "z2_nvme"),
    "sw_z3_nvme": _bind(_setup_shardwise, "z3_nvme"),
    "ds_z3_nvme": _bind(_setup_deepspeed, "z3_nvme"),
    "fsdp2_compile": setup_fsdp2_compile,
    "ds_z2_compile": setup_ds_z2_compile,
    "sw_z2_compile": setup_sw_z2_compile,
    "sw_z2_compile_module": setup_sw_z2_compile_module,
    "sw_z3_compile": setup_sw_z3_compile,
    "sw_z3_offload_dpu_compile": setup_sw_z3_offload_dpu_compile,
    "sw_z2_monitors": setup_sw_z2_monitors,
    "sw_z2_wallclock": setup_sw_z2_wallclock,
    "sw_z2_fp8": setup_sw_z2_fp8,
    "sw_z2_compile_fp8": setup_sw_z2_compile_fp8,
    "sw_z3_compile_fp8": setup_sw_z3_compile_fp8,
}


# ---------------------------------------------------------------------------------------------
# Worker: one variant, in its own process.
# ---------------------------------------------------------------------------------------------
def environment_report(device: torch.device) -> dict[str, Any]:
    import transformers

    report: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                              "transformers": transformers.__version__}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
        report["cuda"] = torch.version.cuda
    for name in ("deepspeed", "shardwise"):
        module = sys.modules.get(name)
        if module is not None:
            report[name] = getattr(module, "__version__", "?")
    return report


def run_worker(name: str, cfg: BenchConfig) -> dict[str, Any]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    model = build_model(cfg, device)
    round_weights_to_bf16(model)
    n_params = count_params(model)
    flops_tok = flops_per_token(cfg, n_params, embedding_params(model))
    batches = make_batches(cfg, device)
    buffers = fp32_buffers(model)
    step = VARIANTS[name](model, batches, cfg, device)
    restored = restore_fp32_buffers(model, buffers)
    measurement = measure(step, cfg, device, setup_s=time.perf_counter() - start)
    return {"variant": name, "n_params": n_params, "flops_per_token": flops_tok,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "restored_fp32_buffers": restored,
            **summarize(measurement, cfg, flops_tok), "env": environment_report(device)}


def worker_main(name: str, cfg: BenchConfig) -> int:
    try:
        result = run_worker(name, cfg)
        code = 0
    except BaseException as exc:  # report anything, KeyboardInterrupt included, as a row
        traceback.print_exc()
        result = {"variant": name, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
        code = 1
    if code != 0 or os.environ.get("RANK", "0") == "0":  # rank 0 speaks for a healthy run
        print(RESULT_MARKER + json.dumps(result), flush=True)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # teardown trouble must not hide the result already printed
        pass
    return code


# ---------------------------------------------------------------------------------------------
# Parent: run the variants one after another, each under a timeout.
# ---------------------------------------------------------------------------------------------
def _worker_env(nproc: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), str(BENCH_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    # DeepSpeed JIT-builds its Adam ops on first use. Keeping the build cache in the ignored
    # out/ folder of the checkout lets it survive between calls on a warm GPU machine.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / "out" / "torch_extensions"))
    # DeepSpeed's op builder cannot parse torch's "9.0a" arch entries; name the plain ones.
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    if nproc == 1:
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                    "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    else:  # the launcher sets them per rank
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE"):
            env.pop(key, None)
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    return env


def _kill_tree(pid: int) -> None:
    """Kill a worker and its children (ninja/nvcc of a JIT build) on any OS."""
    import psutil

    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = parent.children(recursive=True) + [parent]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(line for line in text[-lines:] if not line.startswith(RESULT_MARKER))


def run_subprocess(argv: list[str], log_path: Path, timeout_s: float,
                   nproc: int = 1) -> tuple[int | None, float]:
    """Run argv with output to log_path; returns (exit code or None on timeout, seconds)."""
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(nproc),
                                cwd=str(REPO_ROOT))
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            code = None
    return code, time.perf_counter() - start


def run_variant(name: str, cfg: BenchConfig, timeout_s: float, log_dir: Path,
                verbose: bool) -> dict[str, Any]:
    log_path = log_dir / f"{name}.log"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", name,
            "--config-json", cfg.to_json()]
    if cfg.nproc > 1:  # one process per GPU, started the way users start them
        argv = [sys.executable, "-m", "shardwise", "--num_gpus", str(cfg.nproc), "--no_local_rank",
                "--master_port", str(free_port()), *argv[1:]]
    code, wall = run_subprocess(argv, log_path, timeout_s, cfg.nproc)
    if verbose:
        sys.stderr.write(f"----- {name} log ({log_path})\n{log_path.read_text(errors='replace')}\n")
    result: dict[str, Any] | None = None
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
    if code is None:
        result = {"variant": name, "error": f"timed out after {timeout_s:.0f} s (--timeout)",
                  "log_tail": _tail(log_path)}
    elif result is None:
        result = {"variant": name, "error": f"worker exited with code {code} and no result",
                  "log_tail": _tail(log_path)}
    elif result.get("error"):
        result["log_tail"] = _tail(log_path)
    result["wall_s"] = wall
    return result


def deepspeed_import_error(timeout_s: float, log_dir: Path) -> str | None:
    """None when `import deepspeed` works in a fresh interpreter, else its last error line."""
    log = log_dir / "deepspeed_import.log"
    code, _ = run_subprocess([sys.executable, "-c", "import deepspeed"], log, timeout_s)
    if code == 0:
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {code}"


def prebuild_deepspeed_ops(timeout_s: float, log_dir: Path) -> dict[str, Any]:
    """JIT-build DeepSpeed's CPU Adam and fused Adam once, so no variant's timeout pays it."""
    code = ("from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder\n"
            "CPUAdamBuilder().load()\nFusedAdamBuilder().load()\n")
    log = log_dir / "deepspeed_prebuild.log"
    rc, wall = run_subprocess([sys.executable, "-c", code], log, timeout_s)
    return {"ok": rc == 0, "wall_s": wall, "log_tail": None if rc == 0 else _tail(log)}


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Throughput ratios (tokens/s of the row over tokens/s of the reference)."""
    tok = {r["variant"]: r.get("tokens_per_s") for r in results if not r.get("error")}
    for r in results:
        if r.get("error"):
            continue
        r["mfu_pct"] = 100.0 * r["mfu"]
        r["x_fsdp2"] = ratio(r["tokens_per_s"], tok.get("fsdp2"))
        r["x_torch"] = ratio(r["tokens_per_s"], tok.get("torch"))
        r["x_ddp"] = ratio(r["tokens_per_s"], tok.get("ddp"))
        ds = MATCHING_DS.get(r["variant"])
        r["ds_ref"] = ds
        r["x_ds"] = ratio(r["tokens_per_s"], tok.get(ds)) if ds else None
        # a compiled row against its eager twin and against compiled FSDP2
        compiled = r["variant"].endswith("_compile")
        twin = r["variant"].removesuffix("_compile")
        r["x_eager"] = ratio(r["tokens_per_s"], tok.get(twin)) if compiled else None
        r["x_fsdp2c"] = ratio(r["tokens_per_s"], tok.get("fsdp2_compile")) if compiled else None


def monitor_overhead(results: list[dict[str, Any]]) -> dict[str, float]:
    """Mean step time of each monitor variant over sw_z2's, minus 1 (rows that ran twice are
    averaged, so interleaving sw_z2 and sw_z2_monitors evens out drift)."""
    times: dict[str, list[float]] = {}
    for r in results:
        if not r.get("error"):
            times.setdefault(r["variant"], []).append(r["step_s"])
    base = times.get("sw_z2")
    if not base:
        return {}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {f"{name}_overhead": mean(times[name]) / mean(base) - 1.0
            for name in ("sw_z2_monitors", "sw_z2_wallclock") if name in times}


TABLE_COLUMNS = [
    ("variant", "variant", ""),
    ("tokens_per_s", "tokens/s", ",.0f"),
    ("step_s", "step s", ".3f"),
    ("mfu_pct", "MFU %", ".1f"),
    ("gpu_peak_gib", "GPU peak GiB", ".2f"),
    ("host_rss_peak_gib", "host RSS GiB", ".2f"),
    ("x_fsdp2", "x fsdp2", ".2f"),
    ("x_torch", "x torch", ".2f"),
    ("x_ddp", "x ddp", ".2f"),
    ("x_ds", "x ds", ".2f"),
    ("x_eager", "x eager", ".2f"),  # *_compile rows: over the same variant uncompiled
    ("x_fsdp2c", "x fsdp2_c", ".2f"),  # *_compile rows: over fsdp2_compile
    # Same weights and data everywhere, so a last loss far from torch's flags a broken variant.
    ("loss_last", "last loss", ".4f"),
    ("loss_max_delta", "max |Δloss|", ".4f"),  # filled by --loss-steps
]


def print_agreement(agreement: list[Any], tolerance: float) -> None:
    """The loss-agreement table, and a warning line naming the variants that learn otherwise."""
    print(f"\nloss agreement: per-step loss vs {agreement[0].reference} over the first "
          f"{max(a.steps for a in agreement)} optimizer steps (same weights, data and "
          f"optimizer settings; tolerance {tolerance:g})")
    print(format_table(table_rows(agreement), AGREEMENT_COLUMNS))
    differ = [a.variant for a in agreement if not a.agrees]
    if differ:
        print(f"WARNING: {', '.join(differ)} learn(s) differently from {agreement[0].reference}; "
              f"their tokens/s ratios do not compare the same computation")


def write_json(path: Path | None, cfg: BenchConfig, results: list[dict[str, Any]],
               extra: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"config": asdict(cfg), **extra, "results": results}, indent=2))
    os.replace(tmp, path)  # atomic, so a killed run leaves the last complete file


def default_out() -> Path | None:
    out = os.environ.get("OUT")
    return Path(out) / "train_bench.json" if out else REPO_ROOT / "out" / "train_bench.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, from: {', '.join(VARIANTS)}")
    add_shape_args(p)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="micro batches per optimizer step; tokens/s counts all of them")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed optimizer steps")
    p.add_argument("--steps", type=int, default=d.steps, help="timed optimizer steps")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip,
                   help="global-norm gradient clipping of every variant (0 = none; DeepSpeed's "
                        "own default of 1.0 is overridden so all variants clip alike)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="AdamW weight decay of every variant")
    p.add_argument("--loss-steps", type=int, default=0,
                   help="print the loss-agreement table over the first N optimizer steps "
                        "(warm-up included; --steps is raised so every variant runs N steps)")
    p.add_argument("--loss-ref", default=None,
                   help="reference variant of the loss-agreement table (default: fsdp2, "
                        "sw_z2, ds_z2, torch or ddp, the first one run)")
    p.add_argument("--loss-tol", type=float, default=DEFAULT_TOLERANCE,
                   help="largest max |Δloss| against the reference that counts as bf16 noise")
    p.add_argument("--device", choices=["cuda", "cpu"], default=d.device)
    p.add_argument("--nproc", type=int, default=d.nproc,
                   help="processes (GPUs) per variant, started through the shardwise launcher")
    p.add_argument("--peak-tflops", type=float, default=d.peak_flops / 1e12,
                   help="peak bf16 dense TFLOP/s for MFU (H200: 989)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one variant may take, setup and JIT builds included")
    p.add_argument("--out", type=Path, default=default_out(),
                   help="JSON results file (default $OUT/train_bench.json when OUT is set)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="keep each variant's full log here (default: a temp dir)")
    p.add_argument("--compile-backend", default=None,
                   help=f"torch.compile backend of the *_compile variants (default inductor; "
                        f"aot_eager smoke-tests them on a CPU without a C++ compiler)")
    p.add_argument("--nvme-path", default=None,
                   help="folder for the *_nvme variants' swap files (a fresh temporary folder "
                        "under $TMPDIR or /tmp, removed at the end, when not given)")
    p.add_argument("--ds-prebuild", action="store_true",
                   help="JIT-build DeepSpeed's Adam ops once before the DeepSpeed variants")
    p.add_argument("--verbose", action="store_true", help="echo each worker's log to stderr")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                       heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, seq=args.seq,
                       micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                       warmup=args.warmup, steps=max(args.steps, args.loss_steps - args.warmup),
                       device=args.device, nproc=args.nproc, peak_flops=args.peak_tflops * 1e12,
                       grad_clip=args.grad_clip, weight_decay=args.weight_decay)


def check_args(args: argparse.Namespace, names: list[str]) -> None:
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    for f in ("layers", "hidden", "heads", "kv_heads", "vocab", "seq", "micro_batch",
              "grad_accum", "steps"):
        if getattr(args, f) < 1:
            raise SystemExit(f"--{f.replace('_', '-')} must be >= 1, got {getattr(args, f)}")
    if args.loss_steps < 0 or args.grad_clip < 0 or args.weight_decay < 0:
        raise SystemExit("--loss-steps, --grad-clip and --weight-decay must be >= 0")
    if args.loss_ref and args.loss_ref not in names:
        raise SystemExit(f"--loss-ref {args.loss_ref!r} is not among --variants {names}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise SystemExit(f"--hidden ({args.hidden}) must divide by --heads ({args.heads}) and "
                         f"--heads by --kv-heads ({args.kv_heads})")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU; pass --device cpu to smoke-test")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        cfg = BenchConfig.from_json(args.config_json) if args.config_json else config_from_args(args)
        return worker_main(args.worker, cfg)

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    check_args(args, names)
    if args.compile_backend:  # the workers inherit the parent's environment
        os.environ[COMPILE_BACKEND_ENV] = args.compile_backend
    nvme_tmp = None
    if any("nvme" in n for n in names):
        if args.nvme_path is None:
            nvme_tmp = tempfile.TemporaryDirectory(prefix="train_bench_nvme_")
        os.environ[NVME_PATH_ENV] = args.nvme_path or nvme_tmp.name
        print(f"[train_bench] NVMe swap files under {os.environ[NVME_PATH_ENV]}", flush=True)
    cfg = config_from_args(args)
    tmp = None
    if args.log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="train_bench_")
        log_dir = Path(tmp.name)
    else:
        log_dir = args.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)

    extra: dict[str, Any] = {}
    ds_error = None
    if any(n.startswith("ds_") for n in names):
        ds_error = deepspeed_import_error(min(args.timeout, 120.0), log_dir)
        extra["deepspeed_import_error"] = ds_error
        if ds_error is None and args.ds_prebuild:
            extra["deepspeed_prebuild"] = prebuild_deepspeed_ops(args.timeout, log_dir)
            print(f"[train_bench] deepspeed prebuild: {extra['deepspeed_prebuild']}", flush=True)

    print(f"[train_bench] config {cfg.to_json()}", flush=True)
    results: list[dict[str, Any]] = []
    for name in names:
        if name.startswith("ds_") and ds_error is not None:
            result = {"variant": name, "error": f"skipped: import deepspeed failed: {ds_error}"}
        else:
            result = run_variant(name, cfg, args.timeout, log_dir, args.verbose)
        results.append(result)
        brief = result.get("error") or (f"{result['tokens_per_s']:,.0f} tok/s, "
                                        f"{result['step_s']:.3f} s/step, "
                                        f"GPU peak {result.get('gpu_peak_gib') or float('nan'):.2f} GiB")
        print(f"[train_bench] {name} ({result.get('wall_s', 0):.0f} s): {brief}", flush=True)
        write_json(args.out, cfg, results, extra)  # after each variant, in case we are killed

    add_ratios(results)
    extra.update(monitor_overhead(results))
    agreement = (loss_agreement(results, args.loss_steps, args.loss_ref, args.loss_tol)
                 if args.loss_steps else [])
    annotate(results, agreement)
    extra["loss_agreement"] = table_rows(agreement)
    write_json(args.out, cfg, results, extra)
    n_params = next((r["n_params"] for r in results if "n_params" in r), None)
    print()
    print(f"world size {cfg.nproc} (tokens/s per GPU), "
          f"model {n_params or '?'} params, {cfg.micro_batch}x{cfg.seq} tokens x "
          f"{cfg.grad_accum} micro batches per step, {cfg.warmup} warm-up + {cfg.steps} timed "
          f"steps, MFU vs {cfg.peak_flops / 1e12:.0f} TFLOP/s; ratios are tokens/s ratios")
    print(format_table(results, TABLE_COLUMNS))
    for key, value in monitor_overhead(results).items():
        print(f"{key}: {value:+.2%} mean step time vs sw_z2 (target <= +1% for monitors)")
    if agreement:
        print_agreement(agreement, args.loss_tol)
    if args.out is not None:
        print(f"\nresults: {args.out}")
    if tmp is not None:
        tmp.cleanup()
    if nvme_tmp is not None:
        nvme_tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

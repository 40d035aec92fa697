"""``torch.compile`` for the engine: the ``compile`` config section and ``engine.compile()``.

Compiling is done in place with ``nn.Module.compile()``: the user's module objects stay the
same objects, so ``state_dict`` keys, parameter identity, the ZeRO gradient hooks and
attribute access (``engine.module.model.layers[0]``) are unchanged; only the module's call
goes through dynamo.

Granularity (``compile.granularity``):

* ``"blocks"`` (default, torchtitan's recipe): each child of the model's largest
  ``nn.ModuleList`` whose children are all of one class (a transformer's decoder layers) is
  compiled on its own. The blocks share one code object, so dynamo builds one graph and
  reuses it for every block: compile time is that of one block, and a graph break stays in
  one block. A Hugging Face model's loss function (``model.loss_function``: the logits' upcast
  to fp32 and the cross entropy) is compiled too, as torchtitan compiles its loss: inductor
  fuses the upcast into the softmax, so neither pass writes an fp32 copy of the logits.
  Embeddings, the final norm and the head stay eager.
* ``"module"``: the whole model is one compiled region, as DeepSpeed's ``engine.compile()``
  does.

When compiling cannot work here, the model stays eager with one warning, so a config written
for a GPU still trains on a CPU-only CI machine: no dynamo for this Python/platform, inductor
without Triton (GPU) or without a C++ compiler (CPU), or a backend that fails a tiny probe
compile (forward and backward of a two-op function, once per process). Modules wrapped by
``activation_checkpointing.modules`` stay eager too (warned): the checkpoint wrappers'
recompute does not match a traced forward (torch raises a CheckpointError in backward).

**ZeRO stage 3** (``"deepcompile": true`` is DeepSpeed's name for it) composes with compile the
way FSDP2 does: each block is one compiled region and one stage-3 gather unit. The block's
*forward* is compiled (not its ``__call__``), so its module hooks (gather and prefetch before,
release after, the output hook that re-gathers for backward) run eagerly around the compiled
region, and the modules inside the block lose their own hooks (``ParamCoordinator.set_units``):
nothing of ours is traced, nothing breaks the graph. The gradients' reduce-scatter runs in the
post-accumulate-grad hooks, after the block's compiled backward. The parameters are inputs of
the graph (dynamo guards their shape, dtype and strides, never their address), so each call
reads whatever storage the gather just filled: no stale weight across releases, gathers or
optimizer steps. Modes that capture CUDA graphs (``reduce-overhead``, ``max-autotune``'s
graphs, backend ``cudagraphs``) would pin the gathered buffers' addresses and are switched off
with a warning.

With several ranks the decision is taken together (all ranks compile or none), because the
order in which gradients arrive, and so the order of the bucket reductions, follows the graph.
Nothing here imports dynamo before compiling is asked for: ``import shardwise`` stays fast.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..config.models import check_compile_kwargs
from ..errors import ConfigError
from ..utils.logging import log_dist, warn_once
from .compile_zero3 import GatherUnits, compile_block_forwards, zero3_granularity, zero3_kwargs

Backend = Union[str, Callable[..., Any]]
GRANULARITIES = ("blocks", "module")


@dataclass(frozen=True)
class CompileResult:
    """What ``apply_compile`` did: which modules were compiled, or why none was."""

    backend: str
    """The backend's name (a callable's qualified name)."""
    granularity: str
    """The granularity that was applied: "blocks" or "module" (a model without a block list
    falls back to "module"), or the requested one when nothing was compiled."""
    compiled: Tuple[str, ...] = ()
    """Qualified names of the compiled modules ("" is the model itself)."""
    skipped_reason: Optional[str] = None
    """Why the model stayed eager; None when something was compiled."""
    zero3_units: bool = False
    """ZeRO stage 3: the blocks' forwards were compiled and each block is one gather unit,
    its gathers, releases and prefetches running eagerly around the compiled region."""
    loss: Tuple[str, ...] = ()
    """Qualified names of the modules whose Hugging Face ``loss_function`` was compiled
    (granularity "blocks"; "module" compiles the loss with the rest)."""

    @property
    def is_compiled(self) -> bool:
        return bool(self.compiled)


# --- which modules ----------------------------------------------------------------------
def find_blocks(module: torch.nn.Module) -> Tuple[Optional[str], List[torch.nn.Module]]:
    """The qualified name and children of ``module``'s largest ``nn.ModuleList`` whose children
    all have one class (the repeated blocks); ``(None, [])`` if there is none. Ties go to the
    list with more parameters, then to the first one found."""
    best: Tuple[int, int, Optional[str], List[torch.nn.Module]] = (0, -1, None, [])
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) == 0:
            continue
        blocks = list(child)
        if len({type(b) for b in blocks}) != 1:
            continue
        n_params = sum(p.numel() for p in child.parameters())
        if (len(blocks), n_params) > best[:2]:
            best = (len(blocks), n_params, name, blocks)
    return best[2], best[3]


def _targets(module: torch.nn.Module, granularity: str) -> Tuple[str, List[Tuple[str, torch.nn.Module]]]:
    if granularity == "blocks":
        list_name, blocks = find_blocks(module)
        if blocks:
            prefix = f"{list_name}." if list_name else ""
            return "blocks", [(f"{prefix}{i}", b) for i, b in enumerate(blocks)]
        log_dist(f"compile: {type(module).__name__} has no nn.ModuleList of repeated blocks; "
                 "compiling the whole module (granularity \"module\")", ranks=[0])
    return "module", [("", module)]


# --- can it work here? --------------------------------------------------------------------
def _backend_name(backend: Backend) -> str:
    if isinstance(backend, str):
        return backend
    return getattr(backend, "__qualname__", None) or type(backend).__name__


def resolve_backend(backend: Backend) -> Backend:
    """A registered backend name as is, a callable as is, or the callable a dotted path names
    (DeepSpeed's rule for names that are not registered). ConfigError otherwise."""
    if callable(backend) and not isinstance(backend, str):
        return backend
    if not isinstance(backend, str) or not backend:
        raise ConfigError(f"compile backend {backend!r} must be a backend name, a dotted path "
                          "\"package.module.fn\" or a callable")
    from torch import _dynamo
    known = _dynamo.list_backends(exclude_tags=())
    if backend in known:
        return backend
    module_name, _, fn_name = backend.rpartition(".")
    if module_name:
        try:
            return getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"compile.backend = {backend!r}: not a registered backend and "
                              f"{module_name}.{fn_name} cannot be imported ({exc}). Use one of "
                              f"{', '.join(sorted(known))}, or a dotted path to a backend "
                              "callable.") from None
    raise ConfigError(f"compile.backend = {backend!r} is not a torch.compile backend here; use "
                      f"one of {', '.join(sorted(known))} (e.g. \"backend\": \"inductor\"), or a "
                      "dotted path \"package.module.fn\" to a backend callable.")


def _toolchain_missing(backend: Backend, device: torch.device) -> Optional[str]:
    """Why ``backend`` cannot produce kernels for ``device`` (None: nothing obviously missing)."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    try:
        from torch import _dynamo
        if not _dynamo.is_dynamo_supported():
            return "dynamo (torch.compile) is not supported on this Python/platform"
    except Exception as exc:  # a broken install: report it, stay eager
        return f"torch._dynamo cannot be imported ({type(exc).__name__}: {exc})"
    if backend != "inductor":
        return None
    from ..report_checks import cpu_compiler, triton_available
    if device.type == "cpu" and cpu_compiler() is None:
        return "inductor on CPU generates C++ and no C++ compiler (cl, g++, c++, clang++) is on PATH"
    if device.type in ("cuda", "xpu") and not triton_available():
        return f"inductor on {device.type} needs Triton, which is not installed"
    return None


@functools.lru_cache(maxsize=None)
def _probe(backend: Backend, device_type: str) -> Optional[str]:
    """Compile and run forward + backward of a tiny function; the error text, or None if it works.

    Inductor fails late (at the first call, or at the first backward for the backward graph),
    and a failure then would break a training step; a 2-op probe finds a broken toolchain in
    about a second and once per process."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x * 2.0).sum()

    try:
        x = torch.randn(8, device=device_type, requires_grad=True)
        torch.compile(fn, backend=backend)(x).backward()
        if x.grad is None or not bool(torch.isfinite(x.grad).all()):
            return "the probe compiled but gave no finite gradient"
    except Exception as exc:  # any backend failure means: stay eager
        root: BaseException = exc
        for _ in range(8):  # dynamo wraps the backend's own error (BackendCompilerFailed)
            inner = getattr(root, "inner_exception", None) or root.__cause__
            if inner is None:
                break
            root = inner
        lines = [line for line in str(root).strip().splitlines() if line.strip()]
        return (f"a probe compile with backend {_backend_name(backend)!r} failed: "
                f"{type(root).__name__}: {lines[0] if lines else ''}")
    return None


def _agree(ok: bool, device: torch.device, group: Optional[dist.ProcessGroup]) -> bool:
    """True only if every rank of ``group`` can compile (a MIN all-reduce of the flag)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32,
                        device=device if dist.get_backend(group) != "gloo" else "cpu")
    from ..comm import all_reduce
    all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _raise_recompile_limit(n_blocks: int) -> None:
    """Blocks that differ in a constant their forward reads (a layer index, a sliding window
    on every other layer) each need a graph; dynamo's default limit (8 per code object) would
    leave the later blocks eager. Allow one graph per block, plus the default headroom."""
    import torch._dynamo.config as dcfg
    for name in ("recompile_limit", "cache_size_limit"):
        current = getattr(dcfg, name, None)
        if isinstance(current, int) and current < n_blocks + 8:
            setattr(dcfg, name, n_blocks + 8)


# --- apply ----------------------------------------------------------------------------------
def apply_compile(module: torch.nn.Module, *, backend: Backend = "inductor",
                  kwargs: Optional[Dict[str, Any]] = None, granularity: str = "blocks",
                  zero_stage: int = 0, device: Optional[torch.device] = None,
                  group: Optional[dist.ProcessGroup] = None,
                  units: Optional[GatherUnits] = None) -> CompileResult:
    """Compile ``module`` in place (see the module docstring); returns what was done.

    Under ZeRO stage 3 ``units`` is the engine's gather coordinator: each compiled block
    becomes one of its gather units (``compile_zero3.py``). Raises ConfigError for a bad
    granularity, backend name or keyword argument; environment problems (no toolchain, a
    failing probe) keep the model eager with one warning instead."""
    if granularity not in GRANULARITIES:
        raise ConfigError(f"compile granularity {granularity!r} is not one of "
                          f"{', '.join(GRANULARITIES)} (e.g. \"granularity\": \"blocks\")")
    kwargs = check_compile_kwargs(dict(kwargs or {}), "compile kwargs")
    device = device or torch.device("cpu")
    name = _backend_name(backend)

    def skip(reason: str) -> CompileResult:
        warn_once(f"compile: the model stays eager: {reason}.")
        return CompileResult(name, granularity, (), reason)

    zero3 = zero_stage >= 3
    if zero3:
        reason = _zero3_obstacle(module, name, units)
        if reason is not None:
            return skip(reason)
        granularity, kwargs = zero3_granularity(granularity), zero3_kwargs(kwargs)
    reason = _toolchain_missing(backend, device)
    resolved: Backend = backend
    if reason is None:
        resolved = resolve_backend(backend)  # a bad name is a config error, not a fallback
        reason = _probe(resolved, device.type)
    if not _agree(reason is None, device, group):
        return skip(reason or "another rank cannot compile (see its warning); all ranks stay "
                    "eager so that gradients reach the reductions in the same order everywhere")
    if reason is not None:
        return skip(reason + "; set \"compile\": {\"enabled\": false} (or fix the toolchain) "
                    "to silence this")

    applied, targets = _targets(module, granularity)
    targets = _without_checkpointed(module, targets)
    if not targets:
        return skip("activation_checkpointing wraps every module to compile, and its checkpoint "
                    "wrappers do not run correctly inside a compiled graph; remove "
                    "activation_checkpointing.modules to compile them")
    if applied == "blocks":
        _raise_recompile_limit(len(targets))
    compile_fn = functools.partial(torch.compile, backend=resolved, **kwargs)
    if zero3:
        assert units is not None  # _zero3_obstacle said so
        compile_block_forwards([t for _, t in targets], units, compile_fn)
    else:
        for _, target in targets:
            target.compile(backend=resolved, **kwargs)
    loss = compile_loss_functions(module, compile_fn) if applied == "blocks" else ()
    compiled = tuple(qualname for qualname, _ in targets)
    log_dist(f"compile: backend {name}, granularity {applied}: "
             + (f"{len(compiled)} blocks ({compiled[0]} .. {compiled[-1]})" if applied == "blocks"
                else f"the whole {type(module).__name__}")
             + (", and the loss function" if loss else "")
             + (", ZeRO-3 gathers around each compiled block" if zero3 else "")
             + (f", kwargs {kwargs}" if kwargs else ""), ranks=[0])
    return CompileResult(name, applied, compiled, None, zero3_units=zero3, loss=loss)


def compile_loss_functions(module: torch.nn.Module,
                           compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]
                           ) -> Tuple[str, ...]:
    """Compile the ``loss_function`` of every outermost Hugging Face model in ``module`` (the
    root, or the model a PEFT or user wrapper holds; not the base model inside a
    ``...ForCausalLM``, which never computes the loss); returns their qualified names.

    ``PreTrainedModel.loss_function`` is a property with a setter, so the compiled function is
    set on the instance (the class and other instances keep theirs). A loss function the user
    compiled or replaced is compiled as it is, once."""
    done = []
    for qualname, sub in module.named_modules():
        prop = getattr(type(sub), "loss_function", None)
        if not isinstance(prop, property) or prop.fset is None:
            continue
        if any(qualname.startswith(f"{outer}.") or not outer for outer in done):
            continue
        fn = sub.loss_function
        if getattr(fn, "_torchdynamo_orig_callable", None) is None:
            sub.loss_function = compile_fn(fn)
        done.append(qualname)
    return tuple(done)


def _zero3_obstacle(module: torch.nn.Module, backend_name: str,
                    units: Optional[GatherUnits]) -> Optional[str]:
    """Why stage 3 cannot compile ``module`` (None: it can)."""
    if units is None:
        return ("ZeRO stage 3 compiles each block as one gather unit and no stage-3 gather "
                "coordinator was given (engine.compile() passes the engine's)")
    if backend_name == "cudagraphs":
        return ("backend \"cudagraphs\" captures the weights' addresses, which ZeRO stage 3 "
                "changes at every gather; use \"inductor\" (or \"aot_eager\")")
    if not find_blocks(module)[1]:
        return (f"ZeRO stage 3 compiles each repeated block (a decoder layer) with its gathers "
                f"around it, and {type(module).__name__} has no nn.ModuleList of repeated "
                "blocks; compile under stage 1 or 2, or set \"compile\": {\"enabled\": false}")
    return None


Targets = List[Tuple[str, torch.nn.Module]]


def _without_checkpointed(module: torch.nn.Module, targets: Targets) -> Targets:
    """``targets`` but those activation checkpointing wraps (warned once)."""
    checkpointed = [q for q, t in targets if any(hasattr(m, "_shardwise_ac") for m in t.modules())]
    if checkpointed and len(checkpointed) < len(targets):
        warn_once(f"compile: activation_checkpointing wraps {len(checkpointed)} of the modules to "
                  f"compile ({checkpointed[0] or type(module).__name__}"
                  f"{' ..' if len(checkpointed) > 1 else ''}) and its checkpoint wrappers do not "
                  "run correctly inside a compiled graph; remove activation_checkpointing.modules "
                  "to compile them; they stay eager.")
    return [(q, t) for q, t in targets if q not in checkpointed]


def compile_engine(engine: Any, backend: Optional[Backend] = None,
                   compile_kwargs: Optional[Dict[str, Any]] = None, schedule: Any = None,
                   compiled_autograd_enabled: bool = False,
                   granularity: Optional[str] = None) -> CompileResult:
    """``engine.compile()``: the arguments default to the config's ``compile`` section.

    DeepSpeed's signature; ``schedule`` (DeepCompile's pass schedule) and
    ``compiled_autograd_enabled`` are accepted with a warning and do nothing. A second call
    keeps the first result (DeepSpeed returns early too)."""
    done = engine.__dict__.get("_compile_result")
    if done is not None and done.is_compiled:
        asked = (backend, compile_kwargs, schedule, granularity) != (None,) * 4
        if asked or compiled_autograd_enabled:  # a plain call after the config compiled: quiet
            warn_once("engine.compile(): the model is already compiled (by the config's "
                      "compile section or an earlier call); this call does nothing")
        return done
    section = engine.config.compile
    kwargs = dict(section.kwargs if compile_kwargs is None else compile_kwargs)
    if "backend" in kwargs:  # DeepSpeed: the argument wins, with a warning
        warn_once("engine.compile(): compile_kwargs['backend'] is ignored; pass backend= instead")
        kwargs.pop("backend")
    if schedule is not None:
        warn_once("engine.compile(schedule=...) is DeepCompile's pass schedule and has no effect "
                  "in shardwise")
    if compiled_autograd_enabled:
        warn_once("engine.compile(compiled_autograd_enabled=True) has no effect in shardwise: "
                  "backward runs the compiled blocks' backward graphs, the rest eagerly")
    result = apply_compile(engine.module, backend=section.backend if backend is None else backend,
                           kwargs=kwargs, granularity=granularity or section.granularity,
                           zero_stage=engine.zero_optimization_stage(), device=engine.device,
                           group=engine.dp_group, units=_gather_units(engine))
    engine._compile_result = result
    return result


def _gather_units(engine: Any) -> Optional[GatherUnits]:
    """The stage-3 gather coordinator of ``engine`` (training or parameters-only), if any."""
    units = getattr(engine.strategy, "coordinator", None)
    return units if isinstance(units, GatherUnits) else None


__all__ = ["CompileResult", "apply_compile", "compile_engine", "compile_loss_functions",
           "find_blocks", "resolve_backend"]

"""``torch.compile`` under ZeRO stage 3: one compiled region and one gather unit per block.

FSDP2's recipe with torch.compile, applied to shardwise's stage 3 (``runtime/compile.py`` calls
this when the engine runs stage 3):

1. The stage-3 coordinator gathers each block as one unit (``GatherUnits.set_units``): the
   block's pre-forward hook gathers the parameters of every module under it (and prefetches
   the next blocks), its post-forward hook releases them and hooks the output so that
   backward re-gathers them; the modules inside the block lose their own hooks.
2. The block's ``forward`` is compiled, not its ``__call__`` (``nn.Module.compile()`` would
   compile ``_call_impl``, hooks included): the hooks above run eagerly around the compiled
   region, and nothing of ours is traced. One compiled function serves every block of a class
   (the block is its first argument), so dynamo builds one graph for all of them.

Why no stale weights: the gathered parameters reach the graph as inputs on every call (dynamo
guards their shape, dtype, device and strides, not their address), and the backward graph
reads its saved weights through the same storages, which the pre-backward gather refills
before the block's backward runs. Only CUDA graphs would remember addresses, so the modes that
capture them are switched off here (with a warning).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, runtime_checkable

import torch

from ..utils.logging import warn_once


@runtime_checkable
class GatherUnits(Protocol):
    """What compiling needs from stage 3: gather each block as one piece
    (``zero.stage3.hooks.ParamCoordinator``)."""

    def set_units(self, units: Sequence[torch.nn.Module]) -> None: ...


#: torch.compile modes that capture CUDA graphs, and their equivalent without them.
_GRAPHLESS_MODES = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


def zero3_granularity(granularity: str) -> str:
    """Stage 3 compiles block by block: a whole-model region would have to trace the gathers."""
    if granularity != "blocks":
        warn_once(f"compile: granularity {granularity!r} under ZeRO stage 3 compiles each block "
                  "on its own instead (\"blocks\"): stage 3 gathers and releases the parameters "
                  "around each block, outside the compiled regions; set \"granularity\": "
                  "\"blocks\" to silence this")
    return "blocks"


def zero3_kwargs(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` without CUDA-graph capture: stage 3 refills each block's weights into freshly
    grown storage at every gather, which a captured graph would not see."""
    out = dict(kwargs)
    mode = out.get("mode")
    if mode in _GRAPHLESS_MODES:
        replacement = _GRAPHLESS_MODES[mode]
        if replacement is None:
            out.pop("mode")
        else:
            out["mode"] = replacement
        warn_once(f"compile: mode {mode!r} captures CUDA graphs, which would keep reading the "
                  "addresses of stage 3's first gather; compiling with "
                  f"{'the default mode' if replacement is None else repr(replacement)} instead")
    options = out.get("options")
    if isinstance(options, dict) and options.get("triton.cudagraphs"):
        out["options"] = {**options, "triton.cudagraphs": False}
        warn_once("compile: options[\"triton.cudagraphs\"] is switched off under ZeRO stage 3 "
                  "(CUDA graphs would keep reading the addresses of the first gather)")
    return out


def compile_block_forwards(blocks: Sequence[torch.nn.Module], units: GatherUnits,
                           compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Make each block one gather unit of ``units`` and compile its forward in place.

    ``compile_fn`` is ``torch.compile`` with the backend and keyword arguments bound. A forward
    set on the instance (a wrapper library's patch) is compiled on its own; the class's forward
    is compiled once for all the blocks of that class."""
    units.set_units(list(blocks))
    shared: Dict[Callable[..., Any], Callable[..., Any]] = {}
    for block in blocks:
        own: Optional[Callable[..., Any]] = block.__dict__.get("forward")
        if own is not None:
            block.forward = compile_fn(own)
            continue
        fn = type(block).forward
        if fn not in shared:
            shared[fn] = compile_fn(fn)
        block.forward = functools.partial(shared[fn], block)


__all__ = ["GatherUnits", "compile_block_forwards", "zero3_granularity", "zero3_kwargs"]

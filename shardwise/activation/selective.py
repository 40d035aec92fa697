"""The ``selective`` policy: recompute a block's norms and MLP elementwise ops, nothing else.

Why not torch's op-level selective checkpoint over the whole block (``selective_ops``)? It
runs a Python ``TorchDispatchMode`` on every op of the block, in the forward and again in the
recompute, and it recomputes RoPE, the residual adds and the attention's layout copies, which
save little memory. Per token and layer of a bf16 Hugging Face Llama (hidden H, MLP width I)
the memory is elsewhere:

* each ``LlamaRMSNorm`` keeps an fp32 copy of its input (4H bytes) and the bf16 normalized
  tensor (2H) for its own backward, and its output (2H) is kept again by the projections that
  read it: 8H per norm, where its input is only 2H;
* the gated MLP keeps gate (2I), up (2I), silu(gate) (2I) and their product (2I); the last two
  are one elementwise op each away from the first two.

So inside each wrapped block (the block itself is *not* checkpointed):

* every **norm submodule** (class name ending in ``RMSNorm``/``LayerNorm``, or an
  ``nn.LayerNorm``) keeps only its input. Its backward *and* every consumer that saved its
  output (the q/k/v projections, the MLP) are served by **one** recompute of the norm in
  backward (``NormRecompute``): the norm's saved tensors and its output are rebuilt together
  and dropped once all of them were used. Saves 6H of the 8H, for one extra norm per backward.
* the **MLP submodule** (class name ending in ``MLP``/``Mlp``/``FeedForward``) runs under
  torch's selective checkpoint that keeps the outputs of matmuls: only the activation and the
  product are recomputed (4I saved; the down projection's 2H output is kept so it is not
  recomputed). Its input, the norm's output, is not kept either: it comes from the norm's
  recompute.
* attention, RoPE and the residual adds run as without checkpointing: no dispatch mode, no
  recompute.

At the 1.1B Llama shape (H=2048, I=5632, 4 of 32 KV heads) that is 2 x 12 KiB (norms) +
18 KiB (MLP) = 42 KiB of the 81 KiB per token and layer that full checkpointing saves (52%),
for two norms and two elementwise ops of recompute per layer. A block with no such submodule
falls back to the op-level policy (``selective_ops``).

Norms are assumed deterministic (no dropout inside a norm): their recompute does not replay
RNG states. The MLP's recompute goes through ``run_checkpoint``, which does (dropout inside an
MLP draws the same masks). Both recomputes go through the module's ``__call__``, so module
hooks (ZeRO-3 gathers) run again, and both replay the forward's autocast state.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import ShardwiseError

NORM_SUFFIXES = ("RMSNorm", "LayerNorm")
"""Class-name endings of the submodules whose recompute the ``selective`` policy owns."""
MLP_SUFFIXES = ("MLP", "Mlp", "FeedForward")
"""Class-name endings of the MLP submodules run under the matmul-keeping selective checkpoint."""


def is_norm(module: torch.nn.Module) -> bool:
    """Whether ``selective`` treats ``module`` as a norm (recomputed, input kept)."""
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith(NORM_SUFFIXES)


def is_mlp(module: torch.nn.Module) -> bool:
    """Whether ``selective`` treats ``module`` as an MLP (matmul outputs kept, rest recomputed)."""
    return type(module).__name__.endswith(MLP_SUFFIXES)


def find_parts(block: torch.nn.Module) -> List[Tuple[str, str, torch.nn.Module]]:
    """``(role, qualified name, module)`` for the norms and MLPs inside ``block``.

    Nothing inside a found part is taken again (a norm inside an MLP belongs to the MLP).
    """
    parts: List[Tuple[str, str, torch.nn.Module]] = []
    taken: List[str] = []
    for name, module in block.named_modules():
        if module is block or any(name.startswith(t + ".") for t in taken):
            continue
        role = "norm" if is_norm(module) else "mlp" if is_mlp(module) else None
        if role is not None:
            parts.append((role, name, module))
            taken.append(name)
    return parts


def _no_dispatch_modes():
    """Run a block without the active ``TorchDispatchMode``s (torch's own helper)."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # pragma: no cover - present in every torch >= 2.0
        return contextlib.nullcontext()
    return _disable_current_modes()


def _autocast_state(device_type: str) -> Optional[Tuple[str, torch.dtype, bool]]:
    if not torch.is_autocast_enabled(device_type):
        return None
    return device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()


def _autocast(state: Optional[Tuple[str, torch.dtype, bool]]):
    if state is None:
        return contextlib.nullcontext()
    device_type, dtype, cache = state
    return torch.autocast(device_type=device_type, dtype=dtype, cache_enabled=cache)


class NormRecompute:
    """One norm call whose saved tensors and output are rebuilt by a single recompute.

    The forward runs under ``saved_tensors_hooks`` that keep only an index per saved tensor;
    the norm's inputs are kept instead. The first unpack in backward (of one of the norm's own
    saved tensors, or of its output saved by a consumer) runs the norm again through
    ``module.__call__`` with grad on and the forward's autocast state, collecting what it
    saves in the same order; the result is dropped once every pack was unpacked once.
    """

    def __init__(self, module: torch.nn.Module, call: Callable[..., Any], args: tuple,
                 kwargs: dict, recompute_call: Callable[..., Any]) -> None:
        self.module_name = type(module).__name__
        self.recompute_call = recompute_call
        self.inputs = tree_flatten((args, kwargs))
        device = next((x.device for x in self.inputs[0] if isinstance(x, torch.Tensor)), None)
        self.autocast = _autocast_state(device.type) if device is not None else None
        self.count = 0          # tensors the forward saved
        self.pending = 0        # packs (own and consumers') not unpacked yet
        self.cache: Optional[Tuple[List[torch.Tensor], Any]] = None
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            self.output = call(*args, **kwargs)

    # --- the norm's own saved tensors -----------------------------------------------------
    def _pack(self, t: torch.Tensor) -> int:
        self.count += 1
        self.pending += 1
        return self.count - 1

    def _unpack(self, index: int) -> torch.Tensor:
        saved, _ = self._rebuilt()
        value = saved[index]
        self._used()
        return value

    # --- consumers of the output ----------------------------------------------------------
    def hold_output(self) -> None:
        """A consumer keeps (a view of) the output: count it, so the rebuild waits for it."""
        self.pending += 1

    def output_like(self, size: torch.Size, stride: Tuple[int, ...], offset: int) -> torch.Tensor:
        """The recomputed output, viewed as the consumer saved it."""
        _, out = self._rebuilt()
        view = out.as_strided(size, stride, offset)
        self._used()
        return view

    # --- the recompute --------------------------------------------------------------------
    def _rebuilt(self) -> Tuple[List[torch.Tensor], torch.Tensor]:
        if self.cache is None:
            flat, spec = self.inputs
            flat = [x.detach().requires_grad_(x.requires_grad)
                    if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in flat]
            args, kwargs = tree_unflatten(flat, spec)
            saved: List[torch.Tensor] = []

            def pack(t: torch.Tensor) -> None:
                saved.append(t.detach())  # detached: the recomputed graph itself can go

            with torch.enable_grad(), _autocast(self.autocast), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
                out = self.recompute_call(*args, **kwargs)
            if len(saved) != self.count:
                raise ShardwiseError(
                    f"activation_checkpointing.policy='selective': recomputing {self.module_name} "
                    f"saved {len(saved)} tensors for backward, its forward saved {self.count}; the "
                    f"norm must compute the same ops both times (no data-dependent branches). Use "
                    f"policy 'selective_ops' or 'full' for this model")
            self.cache = (saved, out.detach())
        return self.cache

    def _used(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.cache = None  # everything was handed out; a retain_graph rerun rebuilds it


class RebuiltInput:
    """A checkpoint input that is a norm's output: rebuilt from the norm's recompute."""

    def __init__(self, recipe: NormRecompute, like: torch.Tensor) -> None:
        self.recipe = recipe
        self.size, self.stride, self.offset = like.size(), like.stride(), like.storage_offset()
        self.requires_grad = like.requires_grad
        self.nbytes = 0
        recipe.hold_output()

    def prefetch(self) -> None:
        pass

    def restore(self) -> torch.Tensor:
        # Called inside the MLP's recompute, where torch's selective-checkpoint dispatch mode
        # accepts only the ops the MLP's forward ran: the norm runs outside that mode.
        with _no_dispatch_modes():
            view = self.recipe.output_like(self.size, self.stride, self.offset)
            return view.detach().requires_grad_(self.requires_grad)


class _FromNorm:
    """What a consumer's saved tensor became: the norm that rebuilds it and the view to take."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: NormRecompute, t: torch.Tensor) -> None:
        self.recipe = recipe
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        recipe.hold_output()


class BlockScope:
    """Active while a wrapped block runs its forward: knows the norm outputs made inside it.

    Saved tensors of the block's own ops (attention, RoPE, ...) pass through its hooks; one
    that is (a view of) a norm output becomes a ``_FromNorm`` and is rebuilt in backward.
    """

    def __init__(self) -> None:
        self.norm_outputs: Dict[int, Tuple[torch.Tensor, NormRecompute]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def register(self, recipe: NormRecompute) -> None:
        """Remember ``recipe``'s output (kept alive until the scope ends, so no address reuse)."""
        out = recipe.output
        if (isinstance(out, torch.Tensor) and out.is_contiguous() and out.storage_offset() == 0
                and out.device.type != "meta"):
            self.norm_outputs[out.untyped_storage().data_ptr()] = (out, recipe)

    def recipe_for(self, t: Any) -> Optional[NormRecompute]:
        if not self.norm_outputs or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        hit = self.norm_outputs.get(t.untyped_storage().data_ptr())
        if hit is None or hit[0].dtype != t.dtype or hit[0].device != t.device:
            return None
        return hit[1]

    def rebuild_input(self, x: Any) -> Optional[RebuiltInput]:
        """For ``run_checkpoint``: a norm output among a checkpoint's inputs is not kept."""
        recipe = self.recipe_for(x)
        return None if recipe is None else RebuiltInput(recipe, x)

    def _pack(self, t: torch.Tensor) -> Any:
        recipe = self.recipe_for(t)
        # detach(): keeping an op's own output with its grad_fn would be a reference cycle
        return t.detach() if recipe is None else _FromNorm(recipe, t)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _FromNorm):
            return packed.recipe.output_like(packed.size, packed.stride, packed.offset)
        return packed

    def __enter__(self) -> "BlockScope":
        stack = _scopes()
        stack.append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        _scopes().pop()
        self.norm_outputs.clear()


_LOCAL = threading.local()


def _scopes() -> List[BlockScope]:
    stack = getattr(_LOCAL, "scopes", None)
    if stack is None:
        stack = _LOCAL.scopes = []
    return stack


def current_scope() -> Optional[BlockScope]:
    """The innermost wrapped block whose forward is running on this thread, if any."""
    stack = _scopes()
    return stack[-1] if stack else None

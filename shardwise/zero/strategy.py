"""The interface every ZeRO stage implements; the engine calls only these methods.

One training step, as the engine drives it::

    strategy.before_backward(boundary)      # every micro step
    loss.backward()
    strategy.after_backward(boundary)       # flush reductions still pending
    # on the boundary only:
    grads = strategy.master_grads()         # fp32, reduced, this rank's part (waits)
    ... engine: overflow check, global norm -> one scale factor ...
    strategy.optimizer_step(inner, factor)  # applies the factor, steps the masters
    strategy.after_step()                   # masters -> compute params (+ all-gather)
    strategy.zero_grads()
"""
from __future__ import annotations

from typing import (TYPE_CHECKING, ContextManager, List, Optional, Protocol, Union,
                    runtime_checkable)

import torch

from .shard_view import ShardView

if TYPE_CHECKING:
    from ..monitor.copy_timers import OffloadCopyTimer


@runtime_checkable
class ModelStrategy(Protocol):
    """What the engine asks of any strategy, trained or not (stage 3 without an optimizer
    implements only this: ``zero.stage3.Stage3Params``)."""

    def shard_views(self) -> List[ShardView]:
        """This rank's piece of every parameter (and its fp32 master, when trained)."""
        ...

    def refresh_after_load(self, weights_only: bool = False) -> None:
        """Make every copy consistent after a checkpoint wrote into the views."""
        ...

    def flush(self) -> None:
        """Finish deferred work so the parameters are current."""
        ...

    def no_sync_allowed(self) -> Optional[str]:
        """None if ``engine.no_sync()`` is allowed, else the reason (the error message)."""
        ...

    def remove_hooks(self) -> None:
        """Give the module back to plain autograd (``engine.destroy()``)."""
        ...


@runtime_checkable
class TrainStrategy(ModelStrategy, Protocol):
    """The training contract: the calls of one step (see the module docstring)."""

    stage: int
    grads_partitioned: bool
    world: int

    @property
    def grad_divisor(self) -> float: ...

    def master_param_groups(self) -> List[List[torch.Tensor]]: ...

    def bind_optimizer(self, inner: torch.optim.Optimizer) -> None: ...

    def before_backward(self, boundary: bool) -> None: ...

    def after_backward(self, boundary: bool) -> None: ...

    def master_grads(self) -> List[torch.Tensor]: ...

    def grad_norms(self, grads: List[torch.Tensor], in_order: bool = True) -> List[torch.Tensor]: ...

    def side_norm_stream(self) -> Optional[ContextManager]: ...

    def optimizer_step(self, inner: torch.optim.Optimizer, factor: Optional[torch.Tensor]) -> None: ...

    def after_step(self, applied: bool) -> None: ...

    def zero_grads(self) -> None: ...


EngineStrategy = Union[TrainStrategy, ModelStrategy]
"""What ``ShardwiseEngine.strategy`` holds (None for stages 0-2 without an optimizer)."""


class ZeroStrategy:
    """Base class: documents the contract; stages 0-2 and 3 subclass it."""

    stage: int = 0
    grads_partitioned: bool = False
    """True when each rank holds only part of the gradients, so the global norm needs an
    all-reduce of the local sums of squares."""

    world: int = 1
    """Data-parallel ranks the gradients are reduced over."""
    predivide: float = 1.0
    """gradient_predivide_factor: sums are divided by it before the reduction."""

    @property
    def grad_divisor(self) -> float:
        """What the reduced sums must be divided by to become the data-parallel mean."""
        return self.world / self.predivide if self.world > 1 else 1.0

    def master_param_groups(self) -> List[List[torch.Tensor]]:
        """Per optimizer param group, the fp32 tensors the inner optimizer steps."""
        raise NotImplementedError

    def before_backward(self, boundary: bool) -> None:
        """Called before ``loss.backward()`` on every micro step."""

    def after_backward(self, boundary: bool) -> None:
        """Called after ``loss.backward()``; on the boundary it starts pending reductions."""

    def master_grads(self) -> List[torch.Tensor]:
        """Wait for the reductions; return the fp32 gradient buffers of this rank's masters."""
        raise NotImplementedError

    def grad_norms(self, grads: List[torch.Tensor], in_order: bool = True) -> List[torch.Tensor]:
        """Local L2 norms whose squares sum to this rank's squared gradient norm (``grads``
        is what ``master_grads`` returned). A strategy that already measured its gradients
        (e.g. on the host, as they arrived) returns those norms instead of re-reading them.
        With ``in_order=False`` a norm may still be in the making on the stream of
        :meth:`side_norm_stream`, to be read only inside that context."""
        return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads if g.numel()]

    def side_norm_stream(self) -> Optional[ContextManager]:
        """A context that runs its block on a side stream, for a global norm that the step
        does not depend on (no clipping, no loss scale); None to compute it in stream order
        as usual. A strategy whose gradients finish on a side stream returns that stream,
        so the next window's kernels do not queue behind its tail. The context yields an
        object with ``keep(tensors)`` (tensors of the compute stream read in the block) and
        ``wait()`` (block the host until the block's work is done)."""
        return None

    def optimizer_step(self, inner: torch.optim.Optimizer, factor: Optional[torch.Tensor]) -> None:
        """Multiply the master gradients by ``factor`` (None: leave them) and step ``inner``."""
        raise NotImplementedError

    def set_copy_timer(self, timer: "OffloadCopyTimer") -> None:
        """``wall_clock_breakdown`` with offload: time the offload copies with ``timer``."""

    def bind_optimizer(self, inner: torch.optim.Optimizer) -> None:
        """Called once the inner optimizer steps this strategy's masters."""

    def flush(self) -> None:
        """Finish deferred work (a delayed update) so the parameters are current."""

    def after_step(self, applied: bool) -> None:
        """Write updated masters back into the compute-dtype parameters."""

    def zero_grads(self) -> None:
        raise NotImplementedError

    def shard_views(self) -> List[ShardView]:
        raise NotImplementedError

    def refresh_after_load(self, weights_only: bool = False) -> None:
        """Make every copy consistent after a checkpoint wrote into the owned views."""
        raise NotImplementedError

    def no_sync_allowed(self) -> Optional[str]:
        """None if ``engine.no_sync()`` is allowed, else the reason it is not."""
        return None

    def remove_hooks(self) -> None:
        """Give the module back to plain autograd."""

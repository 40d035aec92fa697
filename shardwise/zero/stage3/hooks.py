"""Module hooks for ZeRO stage 3: gather before use, release after, prefetch ahead.

- **Forward.** A pre-forward hook on every module gathers the partitioned parameters the
  module owns directly (plus any registered with ``register_external_parameter``), then
  prefetches the parameters of the modules that came next in the previous forward's
  recorded order, up to ``prefetch_bucket_size`` elements and within
  ``max_live_parameters``. The post-forward hook releases them unless the recorded order
  says the same parameter is used again within ``max_reuse_distance`` elements (tied
  weights, a layer applied twice).
- **Backward.** The post-forward hook puts a gradient hook on the module's output (a
  structure of outputs goes through an identity ``autograd.Function`` instead); it runs
  just before the module's own backward and gathers the parameters again (and prefetches
  the modules before it in forward order).
  Each parameter is released again as soon as its gradient is accumulated (autograd runs a
  leaf's accumulation once, after all its uses), the rest when backward ends.
- **The two turns.** The last modules of forward are the first of backward, and the first
  modules of forward come right after backward (the next micro step). Their parameters are
  kept gathered across each turn (up to ``prefetch_bucket_size`` elements, at least one
  module: the lm_head and the embedding of a language model), so neither turn waits for a
  fetch that no prefetch could have started earlier. Across an optimizer step nothing is
  kept: the weights change there.
- Nothing assumes that backward follows forward: ``eval()``/``no_grad`` forwards (e.g.
  ``model.generate()``) gather and release in the forward hooks only.

Every decision here (what to prefetch, what to keep) depends only on the recorded order and
the configuration, which are the same on every rank, so all ranks issue the same
collectives in the same order.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Set

import torch

from . import partition as P


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward re-gathers the module's parameters."""

    @staticmethod
    def forward(ctx, coord: "ParamCoordinator", module: torch.nn.Module, pos: int,
                trace: List[torch.nn.Module], *tensors: torch.Tensor):
        ctx.coord, ctx.module, ctx.pos, ctx.trace = coord, module, pos, trace
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.coord.pre_backward(ctx.module, ctx.pos, ctx.trace)
        return (None, None, None, None, *grads)


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def _collect(obj: Any, out: List[torch.Tensor]) -> None:
    if torch.is_tensor(obj):
        if obj.requires_grad and obj.is_floating_point():
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)


def _substitute(obj: Any, new: Dict[int, torch.Tensor]) -> Any:
    if torch.is_tensor(obj):
        return new.get(id(obj), obj)
    if isinstance(obj, list):
        return [_substitute(v, new) for v in obj]
    if isinstance(obj, tuple):
        items = [_substitute(v, new) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: _substitute(v, new) for k, v in obj.items()}
        # dict subclasses (Hugging Face ModelOutput) keep their type: update in place
        for k in list(obj.keys()):
            v = obj[k]
            replaced = _substitute(v, new)
            if replaced is not v:
                obj[k] = replaced
        return obj
    return obj


class ParamCoordinator:
    """Installs the hooks on ``root`` and every submodule and runs the gather schedule."""

    def __init__(self, root: torch.nn.Module, *, prefetch_elems: int, max_live: int,
                 max_reuse: int) -> None:
        self.root = root
        self.prefetch_elems = int(prefetch_elems)
        self.max_live = int(max_live)
        self.max_reuse = int(max_reuse)
        self.trace_prev: List[torch.nn.Module] = []
        """Module order of the last complete root forward."""
        self.trace_cur: List[torch.nn.Module] = []
        self._keep: List[Set[int]] = []
        """Per position of ``trace_prev``: ids of parameters reused soon after it."""
        self.head: Set[int] = set()
        """Ids of the parameters the first modules of ``trace_prev`` use: kept gathered from
        the end of backward into the next forward."""
        self.tail: Set[int] = set()
        """Ids of the parameters the last modules of ``trace_prev`` use: kept gathered from
        the end of a forward that records gradients into its backward."""
        self._trace_params: List[List[torch.nn.Parameter]] = []
        """``params_of`` each module of ``trace_prev``, for the prefetch to walk. Taken when
        the order was recorded: a parameter replaced since would only cost a useless
        prefetch (gathers use the module's current parameters)."""
        self._params_trace: Optional[List[torch.nn.Module]] = None
        self._valid = False
        """The current forward has followed ``trace_prev`` so far."""
        self._stack: List[tuple] = []
        """(trace position, parameters) of each module whose forward is running."""
        self._in_root = False
        self._ahead = 0
        """Trace positions below this one were already prefetched in this forward (or, in
        backward, positions at or above it): each prefetch resumes there instead of
        re-walking the trace, which would cost O(modules²) per pass."""
        self._behind: Optional[int] = None
        self._handles = []
        for m in root.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward, always_call=True))

    # --- which parameters a module needs ---------------------------------------------
    @staticmethod
    def params_of(module: torch.nn.Module) -> List[torch.nn.Parameter]:
        seen, out = set(), []
        for p in list(module._parameters.values()) + list(getattr(module, "_sw_external_params", ())):
            if p is not None and P.is_partitioned(p) and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    # --- forward ----------------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module is self.root:
            self.trace_cur = []
            self._valid = bool(self.trace_prev)
            self._in_root = True
            self._ahead = 0
        pos = -1  # a submodule called on its own: gathered on demand, not traced
        if self._in_root:
            pos = len(self.trace_cur)
            self.trace_cur.append(module)
            if self._valid and (pos >= len(self.trace_prev) or self.trace_prev[pos] is not module):
                self._valid = False  # the model took another path: stop predicting this pass
        params = self.params_of(module)
        self._stack.append((pos, params))  # the post-forward hook releases the same list
        for p in params:
            p.sw_meta.active += 1
        P.gather(params)
        if self._valid and pos >= 0:
            start = max(pos + 1, self._ahead)
            self._ahead = self._prefetch(self.trace_prev, range(start, len(self.trace_prev)), start)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        pos, params = self._stack.pop() if self._stack else (-1, self.params_of(module))
        keep = self._keep[pos] if self._valid and 0 <= pos < len(self._keep) else ()
        # backward starts with the tail's parameters
        tail = self.tail if self._valid and torch.is_grad_enabled() else ()
        # a forward that runs inside backward is an activation-checkpoint recompute: its saved
        # tensors are views of the gathered weights that the backward about to run reads, so
        # they stay gathered until their gradient is accumulated (or backward ends)
        recompute = _in_backward()
        for p in params:
            meta = p.sw_meta
            meta.active = max(0, meta.active - 1)
            if meta.active == 0 and not recompute and id(p) not in keep and id(p) not in tail:
                P.release(p)
        if torch.is_grad_enabled() and (params or module is self.root):
            output = self._wrap_outputs(module, pos, output)
        if module is self.root:
            self._end_forward()
        return output

    def _wrap_outputs(self, module: torch.nn.Module, pos: int, output: Any) -> Any:
        if torch.is_tensor(output):
            # the common case (a Linear): a hook on the tensor itself costs a third of an
            # autograd.Function and leaves the output as it is
            if output.requires_grad and output.is_floating_point():
                trace = self.trace_cur
                output.register_hook(lambda grad: self.pre_backward(module, pos, trace))
            return output
        tensors: List[torch.Tensor] = []
        _collect(output, tensors)
        if not tensors:
            return output
        unique = list({id(t): t for t in tensors}.values())
        wrapped = _PreBackward.apply(self, module, pos, self.trace_cur, *unique)
        return _substitute(output, {id(t): w for t, w in zip(unique, wrapped)})

    def _end_forward(self) -> None:
        followed = self._valid and len(self.trace_cur) == len(self.trace_prev)
        self.trace_prev = self.trace_cur
        if not followed:  # the tables depend on the order only: rebuilt when it changed
            self._trace_params = [self.params_of(m) for m in self.trace_prev]
            self._keep = self._reuse_table(self.trace_prev)
            self.head = self._edge(self.trace_prev)
            self.tail = self._edge(self.trace_prev[::-1])
        self._params_trace = self.trace_prev  # the trace _trace_params describes
        self._stack.clear()
        self._in_root = False
        self._behind = None
        self.sweep(keep=self.tail if followed and torch.is_grad_enabled() else ())

    def _edge(self, modules: List[torch.nn.Module]) -> Set[int]:
        """Parameters of the first ``modules`` up to the prefetch budget (at least one
        module's, however large)."""
        ids: Set[int] = set()
        total = 0
        for m in modules:
            params = [p for p in self.params_of(m) if id(p) not in ids]
            numel = sum(p.sw_meta.padded for p in params)
            if ids and total + numel > self.prefetch_elems:
                break
            ids.update(id(p) for p in params)
            total += numel
        return ids

    def _reuse_table(self, trace: List[torch.nn.Module]) -> List[Set[int]]:
        """For each position, the parameters whose next use is within max_reuse_distance."""
        keep: List[Set[int]] = [set() for _ in trace]
        last: Dict[int, tuple] = {}
        cum = 0
        for i, m in enumerate(trace):
            params = self.params_of(m)
            for p in params:
                if id(p) in last:
                    j, after_j = last[id(p)]
                    if cum - after_j <= self.max_reuse:
                        keep[j].add(id(p))
            cum += sum(p.sw_meta.padded for p in params)
            for p in params:
                last[id(p)] = (i, cum)
        return keep

    # --- backward ---------------------------------------------------------------------
    def pre_backward(self, module: torch.nn.Module, pos: int, trace: List[torch.nn.Module]) -> None:
        P.gather(self.params_of(module))
        if pos > 0:
            start = pos - 1 if self._behind is None else min(pos - 1, self._behind)
            self._behind = self._prefetch(trace, range(start, -1, -1), start)

    # --- prefetch and sweep -------------------------------------------------------------
    def _prefetch(self, trace: List[torch.nn.Module], positions, start: int) -> int:
        """Start gathers along ``positions`` within the budgets; returns the first position
        not fully started (where the next prefetch in this direction resumes)."""
        budget = self.prefetch_elems
        live = P.live_numel()
        batch: Dict[int, torch.nn.Parameter] = {}  # started together: one stream wait, one event
        resume = positions[-1] + (1 if positions.step > 0 else -1) if len(positions) else start
        cached = self._trace_params if trace is self._params_trace else None
        for i in positions:
            full = budget <= 0
            for p in (cached[i] if cached is not None else self.params_of(trace[i])):
                meta = p.sw_meta
                if full or meta.status != P.RELEASED or id(p) in batch:
                    continue
                if live + meta.padded > self.max_live or budget <= 0:
                    full = True
                    continue
                batch[id(p)] = p
                live += meta.padded
                budget -= meta.padded
            if full:
                resume = i
                break
        P.start_gathers(batch.values())
        return resume

    def sweep(self, keep: Iterable[int] = ()) -> None:
        """Release every gathered parameter that no forward or context is using (but those
        whose id is in ``keep``)."""
        keep = set(keep)
        for p in P.live_params():
            if p.sw_meta.active == 0 and id(p) not in keep:
                P.release(p)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

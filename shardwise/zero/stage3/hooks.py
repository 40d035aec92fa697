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
  fetch that no prefetch could have started earlier; so are those reused across the turn
  within ``max_reuse_distance`` elements (DeepSpeed's rule: its trace runs through forward
  and backward), which saves their second gather: with the default 1e9, the decoder layers
  nearest each turn while they total under half of it. Across an optimizer step nothing is
  kept: the weights change there.
- Nothing assumes that backward follows forward: ``eval()``/``no_grad`` forwards (e.g.
  ``model.generate()``) gather and release in the forward hooks only.
- **One recorded order per mode.** A forward that records gradients (training) and one that
  does not (evaluation, ``generate()``) keep separate traces, so evaluating between two
  training steps does not throw away the training order (nor the other way round). Backward
  walks the training forward's trace in reverse: that is the order it runs in.

Every decision here (what to prefetch, what to keep) depends only on the recorded order and
the configuration, which are the same on every rank, so all ranks issue the same
collectives in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set

import torch

from ...errors import ZeroError
from .partition import RELEASED, Partitioner, PartitionedParam


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward re-gathers the module's parameters."""

    @staticmethod
    def forward(ctx, coord: "ParamCoordinator", module: torch.nn.Module, pos: int,
                trace: "Trace", *tensors: torch.Tensor):
        ctx.coord, ctx.module, ctx.pos, ctx.trace = coord, module, pos, trace
        # an output the loss does not use (the logits next to an HF model's loss) gets no
        # gradient, not a materialised zero one: at 8 x 2048 tokens and a 32k vocabulary that
        # zero tensor (and its add into the logits' real gradient) is 1 GiB at the backward peak
        ctx.set_materialize_grads(False)
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


@dataclass(eq=False)
class Trace:
    """The module order of one complete root forward of one mode, and what it implies."""

    modules: List[torch.nn.Module] = field(default_factory=list)
    params: List[List[PartitionedParam]] = field(default_factory=list)
    """The records each module of ``modules`` uses, taken when the order was recorded (a
    parameter replaced since only costs a useless prefetch: gathers use the module's
    current parameters)."""
    keep: List[Set[int]] = field(default_factory=list)
    """Per position: ids of records reused soon after it (kept gathered over the gap)."""
    head: Set[int] = field(default_factory=set)
    """Records the first modules use (up to the prefetch budget) and those the next forward
    reuses within ``max_reuse_distance``: kept gathered from the end of backward into the
    next forward of the same accumulation window."""
    tail: Set[int] = field(default_factory=set)
    """Records the last modules use (up to the prefetch budget) and those backward reuses
    within ``max_reuse_distance``: kept gathered from the end of a forward that records
    gradients into its backward."""


TRAIN, EVAL = "train", "eval"
READ_AHEAD = 64
"""Trace positions past the gathered ones that NVMe read-ahead looks at."""


class ParamCoordinator:
    """Installs the hooks on ``root`` and every submodule and runs the gather schedule of
    one engine's partitioner."""

    def __init__(self, root: torch.nn.Module, partitioner: Partitioner, *, prefetch_elems: int,
                 max_live: int, max_reuse: int) -> None:
        self.root = root
        self.partitioner = partitioner
        self.gathers = partitioner.gathers
        self.prefetch_elems = int(prefetch_elems)
        self.max_live = int(max_live)
        self.max_reuse = int(max_reuse)
        self.traces: Dict[str, Trace] = {TRAIN: Trace(), EVAL: Trace()}
        """The last complete root forward of each mode."""
        self._mode = TRAIN
        self._cur = Trace()
        """The forward in progress: its modules so far; its tables are filled (taken over
        from the mode's trace when it followed it) when it ends."""
        self._valid = False
        """The current forward has followed its mode's trace so far."""
        self._stack: List[tuple] = []
        """(trace position, records) of each module whose forward is running."""
        self._in_root = False
        self._ahead = 0
        """Trace positions below this one were already prefetched in this forward (or, in
        backward, positions at or above it): each prefetch resumes there instead of
        re-walking the trace, which would cost O(modules²) per pass."""
        self._behind: Optional[int] = None
        self._units: Dict[int, torch.nn.Module] = {}
        """Modules gathered as one piece with everything under them (``set_units``)."""
        self._handles: Dict[int, list] = {}
        """The two hooks of each hooked module (by id)."""
        # dynamo never traces the hooks (they swap ``param.data``, which a graph cannot
        # follow): a whole model compiled by its user breaks the graph around each of them and
        # runs them eagerly; the engine's own compile keeps them outside (``set_units``)
        self._pre_hook = torch.compiler.disable(self._pre_forward)
        self._post_hook = torch.compiler.disable(self._post_forward)
        for m in root.modules():
            self._hook(m)

    def _hook(self, m: torch.nn.Module) -> None:
        self._handles[id(m)] = [m.register_forward_pre_hook(self._pre_hook),
                                m.register_forward_hook(self._post_hook, always_call=True)]

    def set_units(self, units: Sequence[torch.nn.Module]) -> None:
        """Gather each of ``units`` (e.g. the decoder layers that ``torch.compile`` compiles one
        by one) as one piece: its hooks gather and release the parameters of every module
        under it, and those modules lose their own hooks, so that nothing of ours runs inside
        the unit's forward (FSDP2's layout: one parameter group per layer, the collectives
        around the layer's call, never inside it). The recorded orders start afresh."""
        for unit in units:
            if id(unit) not in self._handles:
                raise ZeroError(f"set_units: {type(unit).__name__} is not a hooked module of "
                                "this engine's model (or lies inside another unit)")
            self._units[id(unit)] = unit
            for m in unit.modules():
                if m is not unit:
                    self._units.pop(id(m), None)
                    for h in self._handles.pop(id(m), ()):
                        h.remove()
        self.traces = {TRAIN: Trace(), EVAL: Trace()}
        self._cur = Trace()
        self._valid = False

    @property
    def units(self) -> List[torch.nn.Module]:
        """The modules gathered as one piece (``set_units``), in no particular order."""
        return list(self._units.values())

    @property
    def head(self) -> Set[int]:
        """Records the next training forward starts with (kept after a backward)."""
        return self.traces[TRAIN].head

    # --- which parameters a module needs ---------------------------------------------
    def params_of(self, module: torch.nn.Module) -> List[PartitionedParam]:
        """The records ``module`` gathers: its own parameters and external ones (a unit's:
        those of every module under it)."""
        seen, out = set(), []
        record = self.partitioner.record
        members = module.modules() if id(module) in self._units else (module,)
        for m in members:
            for p in list(m._parameters.values()) + list(getattr(m, "_sw_external_params", ())):
                rec = record(p) if p is not None else None
                if rec is not None and id(rec) not in seen:
                    seen.add(id(rec))
                    out.append(rec)
        return out

    # --- forward ----------------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module is self.root:
            self._mode = TRAIN if torch.is_grad_enabled() else EVAL
            self._cur = Trace()
            self._valid = bool(self.traces[self._mode].modules)
            self._in_root = True
            self._ahead = 0
        pos = -1  # a submodule called on its own: gathered on demand, not traced
        trace = self.traces[self._mode]
        if self._in_root:
            pos = len(self._cur.modules)
            self._cur.modules.append(module)
            if self._valid and (pos >= len(trace.modules) or trace.modules[pos] is not module):
                self._valid = False  # the model took another path: stop predicting this pass
        recs = self.params_of(module)
        self._stack.append((pos, recs))  # the post-forward hook releases the same list
        for rec in recs:
            rec.active += 1
        self.gathers.gather(recs)
        if self._valid and pos >= 0:
            start = max(pos + 1, self._ahead)
            self._ahead = self._prefetch(trace, range(start, len(trace.modules)), start)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        pos, recs = self._stack.pop() if self._stack else (-1, self.params_of(module))
        trace = self.traces[self._mode]
        keep = trace.keep[pos] if self._valid and 0 <= pos < len(trace.keep) else ()
        # backward starts with the tail's parameters
        tail = trace.tail if self._valid and torch.is_grad_enabled() else ()
        # a forward that runs inside backward is an activation-checkpoint recompute: its saved
        # tensors are views of the gathered weights that the backward about to run reads, so
        # they stay gathered until their gradient is accumulated (or backward ends)
        recompute = _in_backward()
        for rec in recs:
            rec.active = max(0, rec.active - 1)
            if rec.active == 0 and not recompute and id(rec) not in keep and id(rec) not in tail:
                self.gathers.release(rec)
        if torch.is_grad_enabled() and (recs or module is self.root):
            output = self._wrap_outputs(module, pos, output)
        if module is self.root:
            self._end_forward()
        return output

    def _wrap_outputs(self, module: torch.nn.Module, pos: int, output: Any) -> Any:
        trace = self._cur  # backward prefetches along the order this forward took
        if torch.is_tensor(output):
            # the common case (a Linear): a hook on the tensor itself costs a third of an
            # autograd.Function and leaves the output as it is
            if output.requires_grad and output.is_floating_point():
                output.register_hook(lambda grad: self.pre_backward(module, pos, trace))
            return output
        tensors: List[torch.Tensor] = []
        _collect(output, tensors)
        if not tensors:
            return output
        unique = list({id(t): t for t in tensors}.values())
        wrapped = _PreBackward.apply(self, module, pos, trace, *unique)
        return _substitute(output, {id(t): w for t, w in zip(unique, wrapped)})

    def _end_forward(self) -> None:
        old, cur = self.traces[self._mode], self._cur
        followed = self._valid and len(cur.modules) == len(old.modules)
        if followed:
            cur.params, cur.keep, cur.head, cur.tail = old.params, old.keep, old.head, old.tail
        else:  # the tables depend on the order only: rebuilt when it changed
            self._fill_trace(cur)
        self.traces[self._mode] = cur
        self._cur = Trace()
        self._stack.clear()
        self._in_root = False
        self._behind = None
        tail = self.traces[self._mode].tail
        self.gathers.sweep(keep=tail if followed and torch.is_grad_enabled() else ())

    def _fill_trace(self, trace: Trace) -> None:
        trace.params = [self.params_of(m) for m in trace.modules]
        trace.keep = self._reuse_table(trace.params)
        backward = trace.params[::-1]
        trace.head = self._edge(trace.params) | self._reused_across(backward, trace.params)
        trace.tail = self._edge(backward) | self._reused_across(trace.params, backward)

    def _edge(self, per_module: List[List[PartitionedParam]]) -> Set[int]:
        """Records of the first modules up to the prefetch budget (at least one module's,
        however large)."""
        ids: Set[int] = set()
        total = 0
        for recs in per_module:
            new = [r for r in recs if id(r) not in ids]
            numel = sum(r.padded for r in new)
            if ids and total + numel > self.prefetch_elems:
                break
            ids.update(id(r) for r in new)
            total += numel
        return ids

    def _reused_across(self, before: List[List[PartitionedParam]],
                       after: List[List[PartitionedParam]]) -> Set[int]:
        """Records whose last use in ``before`` (a forward, or a backward) is within
        ``max_reuse_distance`` elements of their first use in ``after`` (the backward that
        follows, or the next forward): DeepSpeed's rule, whose trace runs through both
        passes. The elements between the two uses are those of the modules in between, in
        both passes (a decoder layer near the turn, and the lm_head, stay gathered). What is
        kept leaves ``prefetch_bucket_size`` of room under ``max_live_parameters``, so the
        pass after the turn still prefetches."""
        room = self.max_live - self.prefetch_elems
        after_last: Dict[int, int] = {}
        total = 0
        for recs in before:
            total += sum(r.padded for r in recs)
            for r in recs:
                after_last[id(r)] = total
        kept: Set[int] = set()
        seen: Set[int] = set()
        gap = 0
        for recs in after:
            reused = [r for r in recs if id(r) in after_last and id(r) not in seen
                      and total - after_last[id(r)] + gap <= self.max_reuse]
            numel = sum(r.padded for r in reused)
            if numel > room:  # whole modules, nearest the turn first
                break
            kept.update(id(r) for r in reused)
            room -= numel
            seen.update(id(r) for r in recs)
            gap += sum(r.padded for r in recs)
            if gap > self.max_reuse:
                break
        return kept

    def _reuse_table(self, per_module: List[List[PartitionedParam]]) -> List[Set[int]]:
        """For each position, the records whose next use is within max_reuse_distance."""
        keep: List[Set[int]] = [set() for _ in per_module]
        last: Dict[int, tuple] = {}
        cum = 0
        for i, recs in enumerate(per_module):
            for r in recs:
                if id(r) in last:
                    j, after_j = last[id(r)]
                    if cum - after_j <= self.max_reuse:
                        keep[j].add(id(r))
            cum += sum(r.padded for r in recs)
            for r in recs:
                last[id(r)] = (i, cum)
        return keep

    # --- backward ---------------------------------------------------------------------
    def pre_backward(self, module: torch.nn.Module, pos: int, trace: Trace) -> None:
        self.gathers.gather(self.params_of(module))
        if 0 < pos <= len(trace.params):
            start = pos - 1 if self._behind is None else min(pos - 1, self._behind)
            self._behind = self._prefetch(trace, range(start, -1, -1), start)

    # --- prefetch -----------------------------------------------------------------------
    def _prefetch(self, trace: Trace, positions: range, start: int) -> int:
        """Start gathers along ``positions`` within the budgets; returns the first position
        not fully started (where the next prefetch in this direction resumes)."""
        budget = self.prefetch_elems
        live = self.gathers.live_numel
        batch: Dict[int, PartitionedParam] = {}  # started together: one stream wait, one event
        resume = positions[-1] + (1 if positions.step > 0 else -1) if len(positions) else start
        for i in positions:
            full = budget <= 0
            for rec in trace.params[i]:
                if full or rec.status != RELEASED or id(rec) in batch:
                    continue
                if live + rec.padded > self.max_live or budget <= 0:
                    full = True
                    continue
                batch[id(rec)] = rec
                live += rec.padded
                budget -= rec.padded
            if full:
                resume = i
                break
        self.gathers.start(batch.values())
        if self.partitioner.swapper is not None:  # NVMe: read on past the gathered modules
            self._read_ahead(trace, range(resume, positions.stop, positions.step))
        return resume

    def _read_ahead(self, trace: Trace, positions: range) -> None:
        """offload_param on NVMe: start reading the swap files of the modules along
        ``positions``, in trace order, while read buffers are free (``READ_AHEAD`` modules at
        most; the reads are local, so ranks need not agree on them)."""
        for i in positions[:READ_AHEAD]:
            for rec in trace.params[i]:
                if rec.status == RELEASED and not rec.storage.prefetch():
                    return

    def sweep(self, keep=()) -> None:
        """Release every gathered record of this engine that nothing is using (but ``keep``)."""
        self.gathers.sweep(keep)

    def remove(self) -> None:
        for handles in self._handles.values():
            for h in handles:
                h.remove()
        self._handles.clear()

"""ZeRO stage 3: parameters, gradients and optimizer states all partitioned.

The strategy composes the lifecycle pieces: :class:`~.params.Stage3Params` (placement,
gather/release hooks, state_dict; also the parameters-only stage 3 of inference),
:class:`~.grad_reduce.GradReducer` (each gradient reduce-scattered as autograd finishes it)
and, here, this rank's fp32 masters and their step; the host side of an offloaded step
(gradient streaming, eager piece steps, the delayed update's background step) lives in
``shardwise.offload``.

Layout (see ``partition.py``): each large parameter keeps only this rank's chunk (its
*shard*, compute dtype, on the accelerator or on the CPU under ``offload_param``); small
parameters (fewer than ``param_persistence_threshold`` elements) stay whole on every rank.

- **Forward/backward**: ``hooks.ParamCoordinator`` gathers each module's shards just before
  the module runs (forward and backward) and releases them after, prefetching ahead.
- **Gradients** of partitioned parameters are reduce-scattered as soon as autograd has
  accumulated them, on *every* micro step, straight into this rank's fp32 gradient
  partition (accumulated there across micro steps; on the device, its memory is freed between
  windows). One partition per rank, one reduction per micro step (as DeepSpeed's stage 3).
- **Small (persistent) parameters** are handled like ZeRO stage 2 by a
  ``DataParallelStrategy`` over just those parameters.
- **Masters**: one fp32 flat buffer per optimizer param group holds this rank's owned
  elements of every partitioned parameter of the group; each parameter's piece is a view
  (on the CPU under ``offload_optimizer``, where the step runs). After the step they are cast
  into the shards (on one rank without offload they *are* the shards, cast at gather).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

from ...accelerator import get_accelerator
from ...monitor.copy_timers import OffloadCopyTimer
from ...offload.background_step import background_step
from ...offload.cpu_worker import detached_step
from ...offload.eager_steps import EagerSteps
from ...offload.host_grads import HostGradAccumulator
from ...offload.host_pieces import HostPieces
from ...offload.step_schedule import StepSchedule
from ...offload.nvme_states import NvmeOptimizerStates, pieces_on_nvme
from ...offload.step_subset import HiddenGrads, step_subset
from ...utils.hooks import add_grad_hooks, weak_method
from ...utils.logging import log_dist
from ..data_parallel import DataParallelStrategy
from ..shard_view import ShardView
from ..strategy import ZeroStrategy
from .grad_reduce import GradReducer
from .params import Stage3Params
from .partition import PartitionedParam
from .master_shards import MasterShards, shards_from_masters


class Stage3Strategy(ZeroStrategy):
    stage = 3

    def __init__(self, *, config, module: torch.nn.Module, param_groups: Sequence[Sequence[tuple]],
                 frozen: Sequence[tuple], group: Optional[dist.ProcessGroup],
                 device: torch.device) -> None:
        self.module = module
        self.group = group
        self.device = torch.device(device)
        # 1. placement: partition (or adopt) the large parameters, hooks to gather them
        self.params = Stage3Params(config=config, module=module, group=group, device=device)
        self.partitioner = self.params.partitioner
        self.gathers = self.params.gathers
        self.coordinator = self.params.coordinator
        self.names = self.params.names
        persistent = self.params.persistent
        self.world, self.rank = self.partitioner.world, self.partitioner.rank
        self.grads_partitioned = self.world > 1
        self.compute_dtype = self.params.compute_dtype
        self._read_config(config)

        # 2. persistent parameters: a ZeRO-2 strategy over just them
        whole_groups = [[(n, p) for n, p in named if persistent[id(p)]] for named in param_groups]
        whole_frozen = [(n, p) for n, p in frozen if persistent[id(p)]]
        self.whole = self._build_whole(config, whole_groups, whole_frozen)

        # 3. masters of the partitioned trainable parameters, one flat buffer per group
        self.trainable: List[List[torch.nn.Parameter]] = [
            [p for _, p in named if not persistent[id(p)]] for named in param_groups]
        self.frozen_parts = [p for _, p in frozen if not persistent[id(p)]]
        self._build_masters()
        self.nvme: Optional[NvmeOptimizerStates] = (  # the pieces' masters and states on NVMe
            pieces_on_nvme(config, [(self.piece[pid], self.rec[pid].shard[:self.rec[pid].own_len])
                                    for pid in self.piece]) if self.nvme_opt else None)

        # 4. the offloaded step (eager pieces, DPU) and the hooks: gradients, state_dict
        self._build_offload_step()
        self.reducer = GradReducer(world=self.world, group=group, comm_dtype=self.comm_dtype,
                                   predivide=self.predivide, bucket_elems=self.reduce_bucket,
                                   deliver=self._deliver)
        self._inner: Optional[torch.optim.Optimizer] = None
        self._boundary = False
        self._final: Set[int] = set()
        """Parameters whose boundary gradient is final on the host (norm taken, maybe stepped)."""
        self._written: Set[int] = set()
        """Parameters whose partition received a gradient in this window: the first one
        overwrites (so partitions need no zeroing pass), the others add."""
        self._install_grad_hooks(whole_groups)
        self._log_layout()

    def _read_config(self, config) -> None:
        zero = config.zero_optimization
        comm = getattr(config, "communication_dtype", None)
        # fp32 reductions unless asked otherwise: the sum over ranks keeps full precision
        self.comm_dtype = comm if comm is not None else torch.float32
        self.predivide = float(getattr(config, "gradient_predivide_factor", 1.0) or 1.0)
        self.gather_on_save = bool(zero.gather_16bit_weights_on_model_save)
        self.reduce_bucket = max(1, int(zero.reduce_bucket_size))
        self.offload_param = zero.offload_param_device in ("cpu", "nvme")  # shards on the host
        self.offload_opt = zero.offload_optimizer_device in ("cpu", "nvme")
        self.nvme_opt = zero.offload_optimizer_device == "nvme"
        self.pin_param = bool(self.offload_param and zero.offload_param.pin_memory)
        self.pin_opt = bool(self.offload_opt and zero.offload_optimizer.pin_memory)
        cpu = torch.device("cpu")
        self.shard_device = self.partitioner.shard_device
        self.master_device = cpu if self.offload_opt else self.device
        # delayed parameter update (DPU, opt-in; see _delayed_step): replaces the eager step
        oo = zero.offload_optimizer
        self.delayed = bool(self.offload_opt and getattr(oo, "delayed_update", False))
        self.delay_warmup = int(getattr(oo, "delayed_update_warmup", 0) or 0)
        self._fp16 = bool(config.fp16.enabled)
        # eager CPU step (offload_optimizer): the update of a parameter is known as soon as its
        # last gradient is on the host when nothing global changes it (no clipping, no loss
        # scale), so the worker steps it while backward still runs on earlier layers
        self.eager = (self.offload_opt and not self.delayed and not self._fp16
                      and not float(config.gradient_clipping or 0) > 0 and not self.nvme_opt)

    def _build_whole(self, config, groups: List[List[tuple]],
                     frozen: List[tuple]) -> DataParallelStrategy:
        """The persistent parameters: whole on every rank, handled like ZeRO stage 2."""
        zero = config.zero_optimization
        return DataParallelStrategy(
            stage=2, param_groups=groups, group=self.group, device=self.device,
            compute_dtype=self.compute_dtype, bucket_elems=self.reduce_bucket,
            overlap_comm=bool(zero.overlap_comm),
            comm_dtype=getattr(config, "communication_dtype", None), predivide=self.predivide,
            # persistent masters stay on the device even under offload_optimizer: they are
            # small, and one inner optimizer steps them together with the CPU masters
            offload_device=None, frozen=frozen,
            # DPU: their weights lag their masters by one step, so the two must be apart
            separate_masters=self.delayed)

    def _install_grad_hooks(self, whole_groups: List[List[tuple]]) -> None:
        self._grad_hooks = add_grad_hooks(sum(self.trainable, []), self._on_grad)
        # requires_grad but not given to the optimizer: drop the gradient, free the weight
        self._grad_hooks += add_grad_hooks((p for p in self.frozen_parts if p.requires_grad),
                                           self._drop_grad)
        for named in whole_groups:
            for _, p in named:
                self.partitioner.watch_whole(p, self.whole.refresh_master_of)

    def _log_layout(self) -> None:
        log_dist(f"ZeRO stage 3: masters on {self.master_device}", ranks=[0])
        if self.delayed:
            spare = self.masters.spare_bytes()
            spare += self.shards.spare_bytes()
            log_dist(f"ZeRO stage 3: delayed parameter update after {self.delay_warmup} "
                     f"step(s); a second set of host gradient partitions"
                     f"{' and parameter shards' if self.shards.spare else ''} holds "
                     f"{spare / 2**30:.2f} GiB on this rank", ranks=[0])

    def _build_masters(self) -> None:
        """This rank's fp32 masters and gradient partitions (:class:`HostPieces`)."""
        self.rec: Dict[int, PartitionedParam] = {
            id(p): self.partitioner.record(p) for p in sum(self.trainable, []) + self.frozen_parts}
        """The partition record of each partitioned parameter the strategy trains or skips."""
        self.masters = HostPieces(
            [[(id(p), self.rec[id(p)]) for p in params] for params in self.trainable],
            device=self.master_device, pin=self.pin_opt, double_grads=self.delayed,
            masters_on_nvme=self.nvme_opt, transient_grads=not self.offload_opt)
        refresh = weak_method(self._refresh_master)  # the records outlive this strategy
        for p in sum(self.trainable, []):
            self.rec[id(p)].on_modified = refresh
        if self.world == 1 and not (self.offload_param or self.offload_opt):
            shards_from_masters(self.rec, self.masters.piece)  # no bf16 copy resident

    def _build_offload_step(self) -> None:
        """When the masters are stepped (:class:`StepSchedule`), the eager window and where
        the stepped masters go (:class:`MasterShards`)."""
        self.schedule = StepSchedule(delayed=self.delayed, warmup=self.delay_warmup,
                                     name="shardwise-dpu", worker=self.delayed)
        # DPU with host shards: the background step also writes its result, into a second
        # set of shards swapped in at the next boundary (the step's critical path then holds
        # no pass over the model on the CPU); shards on the device are written at the swap
        self.shards = MasterShards(params=self.params, rec=self.rec, pieces=self.masters.piece,
                                   device=self.device, spare=self.delayed and self.offload_param,
                                   pin=self.pin_param,
                                   masters_on_host=self.offload_opt and not self.offload_param)
        self._bg_hidden = HiddenGrads()
        """Persistent masters' gradients, hidden from the background step."""
        self._acc = HostGradAccumulator(self.device, self.master_device)
        self._copy_timer: Optional[OffloadCopyTimer] = None
        self.eager_steps = EagerSteps(
            pieces=self.masters.piece, grads=lambda: self.masters.grad_of,
            batch_elems=self.reduce_bucket // 10,
            prescale=lambda: 1.0 / self.grad_divisor,
            write_back=self.shards.write_keys if self.offload_param else None)

    # the masters' buffers, by their names of before (for callers outside this class)
    flat_master = property(lambda self: self.masters.flat_master)
    flat_grad = property(lambda self: self.masters.flat_grad)
    piece = property(lambda self: self.masters.piece)
    grad_of = property(lambda self: self.masters.grad_of)

    # --- optimizer groups -------------------------------------------------------------
    def master_param_groups(self) -> List[List[torch.Tensor]]:
        whole = self.whole.master_param_groups()
        pieces = self.masters.piece
        out = []
        for gi, params in enumerate(self.trainable):
            out.append([pieces[id(p)] for p in params if id(p) in pieces] + whole[gi])
        return out

    # --- backward -----------------------------------------------------------------------
    def before_backward(self, boundary: bool) -> None:
        self._boundary = boundary
        if boundary and self.offload_opt:
            self._acc.wait()  # the worker may still run the previous window's tasks
            self._final = set()
            self.eager_steps.reset()
            self._acc.reset_sumsq()
            if self.eager and self._inner is not None and not self.eager_steps.open:
                self.eager_steps.start(m for group in self.whole.master_param_groups()
                                       for m in group)
        self.whole.before_backward(boundary)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        """Autograd finished ``p``'s gradient: reduce-scatter it, free it, release ``p``."""
        rec = self.rec[id(p)]
        self.reducer.reduce(p, rec)
        if rec.active == 0 and id(rec) not in self._kept_for_next_forward():
            self.gathers.release(rec)

    def _drop_grad(self, p: torch.nn.Parameter) -> None:
        p.grad = None
        meta = self.rec[id(p)]
        if meta.active == 0 and id(meta) not in self._kept_for_next_forward():
            self.gathers.release(meta)

    def _kept_for_next_forward(self) -> Set[int]:
        """Records of the parameters the next forward starts with, when no step comes
        between: they stay gathered after this backward."""
        return set() if self._boundary else self.coordinator.head

    def _deliver(self, p: torch.nn.Parameter, rec: PartitionedParam, chunk: torch.Tensor) -> None:
        """A reduced gradient chunk into its fp32 partition (on the host this only queues the
        copy and the add: nothing here waits for the CPU)."""
        grad = self.masters.grad_of.get(id(p))
        if grad is None:
            return
        final = self._boundary and self.offload_opt
        first = id(p) not in self._written
        if not self._written:
            self.masters.regrow_grads()  # the window's first gradient (freed by zero_grads)
        self._written.add(id(p))
        if final:
            self._final.add(id(p))
        self._acc.add_into(grad, chunk, first, final,
                           self.eager_steps.finalizer(id(p))
                           if final and self.eager_steps.open else None)

    def set_copy_timer(self, timer: OffloadCopyTimer) -> None:
        """``wall_clock_breakdown``: gradient copies to the host, shard fetches
        (``offload_param``) and master-to-shard copies (``offload_optimizer`` alone)."""
        self._copy_timer = timer
        self.shards.copy_timer = timer
        if self.offload_opt:
            self._acc.copy_timer = timer
        if self.offload_param:
            self.gathers.copy_timer = timer
        self.whole.set_copy_timer(timer)

    def after_backward(self, boundary: bool) -> None:
        self.reducer.drain()
        self.gathers.sweep(keep=self._kept_for_next_forward())
        self.whole.after_backward(boundary)

    # --- step -----------------------------------------------------------------------------
    def master_grads(self) -> List[torch.Tensor]:
        self.reducer.drain()
        # a delayed step reads the gradients in the background, after waiting for their last
        # copies itself (_delayed_step): the boundary does not wait for the copy stream's tail
        # unless the loss scaler's overflow check must read them now
        if not self._grads_in_flight():
            self._acc.wait()
        self.masters.regrow_grads()  # (a window whose backward produced no gradient)
        for pid, g in self.masters.grad_of.items():
            if pid not in self._written:
                g.zero_()  # no gradient in this window (a skipped module)
                self._written.add(pid)
        return self.masters.grads() + self.whole.master_grads()

    def grad_norms(self, grads: List[torch.Tensor], in_order: bool = True) -> List[torch.Tensor]:
        """Host partitions: the norms the worker took as each gradient became final (a
        parameter that got no gradient on the boundary micro step is measured here).
        Out of order, their total is summed on the copy stream, behind the last copies."""
        if not self.offload_opt:
            return super().grad_norms(grads)
        n_host = len(self.masters.grads())
        grad_of = self.masters.grad_of
        rest_ids = [pid for pid in grad_of if pid not in self._final]
        if rest_ids and self._grads_in_flight():
            self._acc.wait()  # a parameter without a boundary gradient is measured on the host
        rest = sum(float(torch.dot(grad_of[pid], grad_of[pid])) for pid in rest_ids)
        whole = super().grad_norms(grads[n_host:])
        side = self.side_norm_stream() if not in_order else None
        with side if side is not None else contextlib.nullcontext():
            host_part = (self._acc.sumsq() + rest).sqrt()
        return [host_part] + whole

    def side_norm_stream(self):
        """The copy stream, where the boundary's last gradients are still travelling: a norm
        that the step does not need is summed there, behind them (None without copies)."""
        return self._acc.on_side_stream() if self._acc.stream is not None else None

    def optimizer_step(self, inner: torch.optim.Optimizer, factor: Optional[torch.Tensor]) -> None:
        """Scale the fp32 gradient partitions by the engine's factor and step the masters."""
        if self.eager_steps.open:
            # the worker stepped the pieces whose gradient was final during backward (with
            # the same factor: 1/DP divisor); step the rest, then the persistent parameters
            self._acc.wait()
            self.eager_steps.finish([id(p) for params in self.trainable for p in params],
                                    lambda: self.whole.optimizer_step(inner, factor))
            return
        if self.schedule.begin_step():
            self._delayed_step(inner, factor)
            return
        self.masters.scale_grads(factor)
        if self.nvme is not None:
            self._nvme_step(inner, factor)
            return
        if self.delayed:
            self.masters.attach_grads(True)
        # scales the persistent parameters' gradients too, then runs inner.step() once
        self.whole.optimizer_step(inner, factor)

    # --- offload_optimizer on NVMe (offload/nvme_states.py) ---------------------------------
    def _nvme_step(self, inner: torch.optim.Optimizer, factor: Optional[torch.Tensor]) -> None:
        """Persistent masters, then the pieces' sub-groups streamed from swap, each written."""
        self.masters.attach_grads(False)
        self.whole.optimizer_step(inner, factor)  # the pieces have no gradient attached
        whole = [m for group in self.whole.master_param_groups() for m in group]
        pid_of = {id(piece): pid for pid, piece in self.piece.items()}
        self.params.before_shard_write()

        def step(i: int) -> None:
            keys = self.nvme.groups[i].keys
            step_subset(inner.step, [(k, self.grad_of[pid_of[id(k)]]) for k in keys], hide=whole)

        def to_device(i: int):
            for key in self.nvme.groups[i].keys:
                self.rec[pid_of[id(key)]].storage.write_(key, non_blocking=True)
            if self.offload_param or self.device.type != "cuda":
                return None  # host shards: written synchronously
            done = get_accelerator().Event()
            done.record(get_accelerator().current_stream(self.device))
            return done.synchronize  # the ring buffer is read again only after this copy

        self.nvme.step_groups(step, to_device)

    # --- delayed parameter update (DPU) ----------------------------------------------------
    def _delayed_step(self, inner: torch.optim.Optimizer, factor: Optional[torch.Tensor]) -> None:
        """Step t's update starts in the background and reaches the weights at step t+1's
        boundary, so the CPU work overlaps step t+1's forward and backward: with masters w
        and the weights the model computes with p, ``w[t+1] = w[t] - u(g(p[t]))`` where
        ``p[t] = w[t-1]`` (ZeRO-Offload, section 4.3). Every parameter is one step stale,
        persistent ones included: their (small) device step runs here, but their weights are
        written only when the partitioned ones are."""
        self._apply_delayed()  # the update of step t-1 into the weights: they become w[t]
        self.masters.attach_grads(False)
        self.whole.optimizer_step(inner, factor)  # persistent masters only (pieces have no grad)
        self.masters.attach_grads(True)
        self._bg_hidden.hide(m for group in self.whole.master_param_groups() for m in group)
        # the scheduler changes the rates as soon as the engine's step returns: a snapshot
        self.schedule.submit_delayed(background_step(
            step=detached_step(inner), grads=self.masters.grads(), factor=factor,
            master_device=self.master_device, grads_ready=self._acc.fence(),
            writes=self.shards.spare_writes()))
        # the next window accumulates into the other partitions while this one is stepped
        self.masters.swap_grads()

    def _grads_in_flight(self) -> bool:
        """Between master_grads and the step: the boundary's last gradient copies are left in
        flight for the delayed step to wait for."""
        return self.schedule.next_delayed() and not self._fp16

    def _apply_delayed(self) -> None:
        """Finish the background step and write its result into the weights."""
        if not self.schedule.finish_delayed():
            return
        self._bg_hidden.restore()
        self.masters.attach_grads(False)
        if self.shards.spare:
            self.shards.swap_spares()
        else:
            self.shards.write()
        self.whole.after_step(True)

    def bind_optimizer(self, inner: torch.optim.Optimizer) -> None:
        self._inner = inner
        self.eager_steps.inner = inner
        if self.nvme is not None:
            self.nvme.bind(inner)
        self.whole.bind_optimizer(inner)

    def flush(self) -> None:
        """Bring a pending delayed update into the weights (before saving or evaluating)."""
        self._apply_delayed()
        self.whole.flush()

    def after_step(self, applied: bool) -> None:
        if not applied:
            return
        if self.schedule.delayed_now:
            self.gathers.sweep()
            return  # written at the next boundary (or by flush), one step late by design
        self._acc.wait()
        skip = self.eager_steps.stepped if self.offload_param else set()
        self.shards.write(skip=set(self.piece) if self.nvme is not None else skip)
        self.eager_steps.stepped = set()
        self.whole.after_step(applied)

    def zero_grads(self) -> None:
        if self.eager_steps.open:
            self._acc.wait()
            self.eager_steps.restore(pieces=False)
            self.eager_steps.restore(pieces=True)
        # nothing to clear: each partition's first gradient of the next window overwrites it
        # (master_grads zeroes those that get none); the copy stream runs in order, so the
        # next window's copies follow a delayed step's still in flight
        if not self.schedule.delayed_now:
            self._acc.wait()
        self.masters.free_grads()
        self._written = set()
        for params in self.trainable:
            for p in params:
                p.grad = None
        self.whole.zero_grads()

    # --- checkpoint contract -------------------------------------------------------------
    def shard_views(self) -> List[ShardView]:
        self.flush()
        if self.nvme is not None:
            self.nvme.materialize()  # masters and states from swap, until the next step
        views = []
        for p in [p for params in self.trainable for p in params] + self.frozen_parts:
            meta = self.rec[id(p)]
            views.append(ShardView(name=self.names[id(p)], param=p, global_shape=meta.shape,
                                   start=meta.own_lo, end=meta.own_hi,
                                   weight=meta.shard[:meta.own_len],
                                   master=self.masters.piece.get(id(p))))
        return views + self.whole.shard_views()

    def refresh_after_load(self, weights_only: bool = False) -> None:
        self.flush()
        self._acc.wait()
        if self.nvme is not None:
            self.nvme.materialize()
        self.shards.load(weights_only)
        if self.nvme is not None:
            self.nvme.dematerialize(write=True)  # the loaded values into the swap files
        self.whole.refresh_after_load(weights_only)

    def no_sync_allowed(self) -> Optional[str]:
        return self.params.no_sync_allowed()

    # --- GatheredParameters(modifier_rank=...) support ---------------------------------
    def _refresh_master(self, p: torch.nn.Parameter) -> None:
        piece = self.masters.piece.get(id(p))
        if piece is None:
            return
        rec = self.rec[id(p)]
        if self.nvme is not None:  # its sub-group is in a swap file
            with torch.no_grad():
                self.nvme.edit(piece, lambda m: m.copy_(rec.shard[:m.numel()]))
            return
        with torch.no_grad():
            if self.schedule.pending is not None:
                # a delayed update is still pending: it reaches every weight first (it would
                # otherwise overwrite the edit at the next boundary), then the edit wins
                edited = rec.shard[:piece.numel()].clone()
                self.flush()
                rec.storage.write_(edited)  # the storages may have been swapped meanwhile
            piece.copy_(rec.shard[:piece.numel()])

    def remove_hooks(self) -> None:
        self.flush()
        self.schedule.close()
        self._acc.close()
        if self.nvme is not None:
            self.nvme.close()
        for h in self._grad_hooks:
            h.remove()
        self.params.remove_hooks()
        self.whole.remove_hooks()

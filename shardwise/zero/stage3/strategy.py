"""ZeRO stage 3: parameters, gradients and optimizer states all partitioned.

Layout (see ``partition.py``): each large parameter keeps only this rank's chunk (its
*shard*, compute dtype, on the accelerator or on the CPU under ``offload_param``); small
parameters (fewer than ``param_persistence_threshold`` elements) stay whole on every rank.

- **Forward/backward**: ``hooks.ParamCoordinator`` gathers each module's shards just before
  the module runs (forward and backward) and releases them after, prefetching ahead.
- **Gradients** of partitioned parameters are reduce-scattered as soon as autograd has
  accumulated them, on *every* micro step, straight into this rank's fp32 gradient
  partition (accumulated there across micro steps); the full-size gradient is freed at
  once. Memory therefore stays at one partition per rank, at the price of one reduction per
  micro step (DeepSpeed stage 3 makes the same choice).
- **Small (persistent) parameters** are handled exactly like ZeRO stage 2, by a
  ``DataParallelStrategy`` over just those parameters: whole weights on every rank,
  gradients bucketed and reduce-scattered on the boundary, fp32 masters partitioned.
- **Masters**: one fp32 flat buffer per optimizer param group holds this rank's owned
  elements of every partitioned parameter of the group; each parameter's piece is a view,
  so the optimizer's state maps onto ``ShardView``s one to one. Under
  ``offload_optimizer`` it lives in (pinned) CPU memory and the step runs on the CPU.
- **After the step** the masters are cast into the shards; nothing is all-gathered until
  the next forward needs it.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

from ...comm import reduce_scatter_flat
from ...errors import ConfigError, ZeroError
from ...offload.cpu_worker import cpu_step_pool, detached_step
from ...utils.logging import log_dist
from ..data_parallel import DataParallelStrategy
from ..shard_view import ShardView
from ..strategy import ZeroStrategy
from . import partition as P
from .hooks import ParamCoordinator
from .param_offload import HostGradAccumulator, alloc_host


class Stage3Strategy(ZeroStrategy):
    stage = 3

    def __init__(self, *, config, module: torch.nn.Module, param_groups: Sequence[Sequence[tuple]],
                 frozen: Sequence[tuple], group: Optional[dist.ProcessGroup],
                 device: torch.device) -> None:
        zero = config.zero_optimization
        self.module = module
        self.group = group
        self.device = torch.device(device)
        self.world, self.rank = P.group_info(group)
        self.grads_partitioned = self.world > 1
        self.compute_dtype = (config.compute_dtype if not config.torch_autocast.enabled
                              else torch.float32)
        comm = getattr(config, "communication_dtype", None)
        # fp32 reductions unless asked otherwise: the sum over ranks keeps full precision
        self.comm_dtype = comm if comm is not None else torch.float32
        self.predivide = float(getattr(config, "gradient_predivide_factor", 1.0) or 1.0)
        self.gather_on_save = bool(zero.gather_16bit_weights_on_model_save)
        self.reduce_bucket = max(1, int(zero.reduce_bucket_size))
        for key, dev in (("offload_param", zero.offload_param_device),
                         ("offload_optimizer", zero.offload_optimizer_device)):
            if dev == "nvme":
                raise ConfigError(f"zero_optimization.{key}.device = \"nvme\" is not supported by "
                                  "shardwise (no async-IO extension is compiled); use \"cpu\"")
        self.offload_param = zero.offload_param_device == "cpu"
        self.offload_opt = zero.offload_optimizer_device == "cpu"
        self.pin_param = bool(self.offload_param and zero.offload_param.pin_memory)
        self.pin_opt = bool(self.offload_opt and zero.offload_optimizer.pin_memory)
        cpu = torch.device("cpu")
        self.shard_device = cpu if self.offload_param else self.device
        self.master_device = cpu if self.offload_opt else self.device
        # delayed parameter update (DPU, opt-in; see _delayed_step): replaces the eager step
        oo = zero.offload_optimizer
        self.delayed = bool(self.offload_opt and getattr(oo, "delayed_update", False))
        self.delay_warmup = int(getattr(oo, "delayed_update_warmup", 0) or 0)
        self.steps_done = 0
        self._fp16 = bool(config.fp16.enabled)
        # eager CPU step (offload_optimizer): the update of a parameter is known as soon as its
        # last gradient is on the host when nothing global changes it (no clipping, no loss
        # scale), so the worker steps it while backward still runs on earlier layers
        self.eager = (self.offload_opt and not self.delayed and not self._fp16
                      and not float(config.gradient_clipping or 0) > 0)

        # 1. decide which parameters stay whole, partition (or adopt) the others
        threshold = int(zero.param_persistence_threshold)
        budget = int(zero.model_persistence_threshold)
        self.names: Dict[int, str] = {}
        persistent: Dict[int, bool] = {}
        for name, p in module.named_parameters():
            self.names[id(p)] = name
            numel = p.sw_numel if P.is_partitioned(p) else p.numel()
            keep = numel < threshold and budget - numel >= 0
            if keep:
                budget -= numel
            persistent[id(p)] = keep
            if keep and P.is_partitioned(p):
                P.unpartition(p)
            elif not keep:
                self._partition(p)
        # placeholders, whole parameters and buffers to the compute device and dtype
        module.to(device=self.device, dtype=self.compute_dtype)

        # 2. persistent parameters: a ZeRO-2 strategy over just them
        whole_groups = [[(n, p) for n, p in named if persistent[id(p)]] for named in param_groups]
        whole_frozen = [(n, p) for n, p in frozen if persistent[id(p)]]
        self.whole = DataParallelStrategy(
            stage=2, param_groups=whole_groups, group=group, device=self.device,
            compute_dtype=self.compute_dtype, bucket_elems=self.reduce_bucket,
            overlap_comm=bool(zero.overlap_comm), comm_dtype=comm, predivide=self.predivide,
            # persistent masters stay on the device even under offload_optimizer: they are
            # small, and one inner optimizer steps them together with the CPU masters
            offload_device=None, frozen=whole_frozen,
            # DPU: their weights lag their masters by one step, so the two must be apart
            separate_masters=self.delayed)

        # 3. masters of the partitioned trainable parameters, one flat buffer per group
        self.trainable: List[List[torch.nn.Parameter]] = [
            [p for _, p in named if not persistent[id(p)]] for named in param_groups]
        self.frozen_parts = [p for _, p in frozen if not persistent[id(p)]]
        self.flat_master: List[torch.Tensor] = []
        self.flat_grad: List[torch.Tensor] = []
        self.piece: Dict[int, torch.Tensor] = {}
        self.grad_of: Dict[int, torch.Tensor] = {}
        """fp32 gradient partition of each partitioned parameter (a view into flat_grad)."""
        # DPU steps one window's gradients in the background while the next window writes
        # its own: a second set of gradient partitions, swapped at every delayed step
        self._spare_grads: tuple = ([], {})
        for params in self.trainable:
            total = sum(p.sw_meta.own_len for p in params)
            master = alloc_host(total, self.master_device, self.pin_opt)
            grads = [alloc_host(total, self.master_device, self.pin_opt)
                     for _ in range(2 if self.delayed else 1)]
            off = 0
            for p in params:
                meta = p.sw_meta
                view = master[off:off + meta.own_len]
                view.copy_(meta.shard[:meta.own_len])
                view.grad = grads[0][off:off + meta.own_len]
                if meta.own_len:
                    self.piece[id(p)] = view
                    self.grad_of[id(p)] = view.grad
                    if self.delayed:
                        self._spare_grads[1][id(p)] = grads[1][off:off + meta.own_len]
                off += meta.own_len
                meta.on_modified = self._refresh_master
            self.flat_master.append(master)
            self.flat_grad.append(grads[0])
            if self.delayed:
                self._spare_grads[0].append(grads[1])
        self._bg: Optional[Future] = None
        """The background (delayed) step of the last boundary, not yet in the weights."""
        # DPU with host shards: the background step also writes its result, into a second
        # set of shards swapped in at the next boundary (the step's critical path then holds
        # no pass over the model on the CPU); shards on the device are written at the swap
        self._spare_shards: Dict[int, torch.Tensor] = {}
        if self.delayed and self.offload_param:
            for params in self.trainable:
                for p in params:
                    if id(p) in self.piece:
                        shard = p.sw_meta.shard
                        self._spare_shards[id(p)] = P.place_shard(shard, shard.device,
                                                                  shard.dtype, self.pin_param)
        self._bg_hidden: List[tuple] = []
        self._delayed_now = False
        self._bg_pool = cpu_step_pool("shardwise-dpu") if self.delayed else None

        # 4. hooks: gradients, module gather schedule, state_dict
        self._pending: List[tuple] = []
        self._pending_elems = 0
        # one rank has no collective to batch: hand each gradient to the host at once
        self._drain_elems = self.reduce_bucket if self.world > 1 else 0
        self._acc = HostGradAccumulator(self.device, self.master_device)
        self._inner: Optional[torch.optim.Optimizer] = None
        self._boundary = False
        self._final: Set[int] = set()
        """Parameters whose boundary gradient is final on the host (norm taken, maybe stepped)."""
        self._ready: List[torch.nn.Parameter] = []
        self._ready_elems = 0
        self._stepped: Set[int] = set()
        self._eager_window = False
        self._hidden: List[tuple] = []
        self._written: Set[int] = set()
        """Parameters whose partition received a gradient in this window: the first one
        overwrites (so partitions need no zeroing pass), the others add."""
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                            for params in self.trainable for p in params]
        # requires_grad but not given to the optimizer: drop the gradient, free the weight
        self._grad_hooks += [p.register_post_accumulate_grad_hook(self._drop_grad)
                             for p in self.frozen_parts if p.requires_grad]
        self.coordinator = ParamCoordinator(
            module, prefetch_elems=int(zero.prefetch_bucket_size),
            max_live=int(zero.max_live_parameters), max_reuse=int(zero.max_reuse_distance))
        self._sd_hooks = []
        for m in module.modules():
            if any(P.is_partitioned(p) for p in m._parameters.values()):
                self._sd_hooks.append(m._register_state_dict_hook(self._state_dict_hook))
            if any(p is not None for p in m._parameters.values()):
                self._sd_hooks += [m._register_load_state_dict_pre_hook(self._load_pre_hook,
                                                                        with_module=True),
                                   m.register_load_state_dict_post_hook(self._load_post_hook)]
        for named in whole_groups:
            for _, p in named:
                p._sw_on_modified = self._refresh_whole
        n_part = sum(1 for p in module.parameters() if P.is_partitioned(p))
        log_dist(f"ZeRO stage 3: {n_part} partitioned parameters over {self.world} ranks, "
                 f"{sum(persistent.values())} persistent; params on {self.shard_device}, "
                 f"masters on {self.master_device}", ranks=[0])
        if self.delayed:
            spare = sum(g.numel() for g in self._spare_grads[0]) * 4
            spare += sum(t.numel() * t.element_size() for t in self._spare_shards.values())
            log_dist(f"ZeRO stage 3: delayed parameter update after {self.delay_warmup} "
                     f"step(s); a second set of host gradient partitions"
                     f"{' and parameter shards' if self._spare_shards else ''} holds "
                     f"{spare / 2**30:.2f} GiB on this rank", ranks=[0])

    def _partition(self, p: torch.nn.Parameter) -> None:
        if P.is_partitioned(p):
            P.adopt(p, shard_device=self.shard_device, compute_device=self.device,
                    dtype=self.compute_dtype, pin=self.pin_param, world=self.world)
            p.sw_meta.group = self.group
            return
        P.partition_param(p, world=self.world, rank=self.rank, group=self.group,
                          shard_device=self.shard_device, compute_device=self.device,
                          dtype=self.compute_dtype, pin=self.pin_param)

    # --- optimizer groups -------------------------------------------------------------
    def master_param_groups(self) -> List[List[torch.Tensor]]:
        whole = self.whole.master_param_groups()
        out = []
        for gi, params in enumerate(self.trainable):
            out.append([self.piece[id(p)] for p in params if id(p) in self.piece] + whole[gi])
        return out

    # --- backward -----------------------------------------------------------------------
    def before_backward(self, boundary: bool) -> None:
        self._boundary = boundary
        if boundary and self.offload_opt:
            self._acc.wait()  # the worker may still run the previous window's tasks
            self._final, self._stepped = set(), set()
            self._acc.reset_sumsq()
            self._ready, self._ready_elems = [], 0
            if self.eager and self._inner is not None and not self._eager_window:
                # the worker's optimizer steps must see only the pieces they update
                self._eager_window = True
                self._hidden = [(m, m.grad) for group in self.whole.master_param_groups()
                                for m in group]
                self._hidden += [(pc, pc.grad) for pc in self.piece.values()]
                for m, _ in self._hidden:
                    m.grad = None
        self.whole.before_backward(boundary)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        """Autograd finished ``p``'s gradient: reduce-scatter it, free it, release ``p``."""
        grad, p.grad = p.grad, None
        meta: P.PartitionedParam = p.sw_meta
        if grad is not None:
            if self.world == 1 and self.predivide == 1.0:
                # nothing to pad or reduce: the gradient goes to its partition as it is (in
                # its own dtype, so a bf16 gradient crosses PCIe at half the bytes)
                out = buf = grad.reshape(-1)
                work = None
            else:
                buf = torch.zeros(meta.padded, dtype=self.comm_dtype, device=grad.device)
                buf[:meta.numel].copy_(grad.reshape(-1))
                if self.predivide != 1.0:
                    buf.div_(self.predivide)
            del grad
            if self.world == 1:
                out, work = buf, None
            else:
                out = torch.empty(meta.chunk, dtype=self.comm_dtype, device=buf.device)
                work = reduce_scatter_flat(out, buf, group=self.group, async_op=True)
            self._pending.append((p, work, out, buf))
            self._pending_elems += meta.padded
            if self._pending_elems > self._drain_elems:
                self._drain(keep_last=1 if self.world > 1 else 0)
        if meta.active == 0 and id(p) not in self._kept_for_next_forward():
            P.release(p)

    def _drop_grad(self, p: torch.nn.Parameter) -> None:
        p.grad = None
        if p.sw_meta.active == 0 and id(p) not in self._kept_for_next_forward():
            P.release(p)

    def _kept_for_next_forward(self) -> Set[int]:
        """Parameters the next forward starts with, when no step comes between: they stay
        gathered after this backward."""
        return set() if self._boundary else self.coordinator.head

    def _drain(self, keep_last: int = 0) -> None:
        """Wait for queued reductions and hand them to the fp32 gradient partitions (on the
        host this only queues the copy and the add: nothing here waits for the CPU)."""
        while len(self._pending) > keep_last:
            p, work, out, buf = self._pending.pop(0)
            self._pending_elems -= p.sw_meta.padded
            if work is not None:
                work.wait()
            if id(p) in self.grad_of:
                final = self._boundary and self.offload_opt
                first = id(p) not in self._written
                self._written.add(id(p))
                if final:
                    self._final.add(id(p))
                self._acc.add_into(self.grad_of[id(p)], out[:p.sw_meta.own_len], first, final,
                                   self._finalizer(p) if final and self._eager_window else None)

    # --- host-side work after a parameter's last gradient (runs on the worker) -------------
    def _finalizer(self, p: torch.nn.Parameter):
        """The eager step's bookkeeping once ``p``'s last gradient is on the host."""
        def run() -> None:
            self._ready.append(p)
            self._ready_elems += self.grad_of[id(p)].numel()
            if self._ready_elems >= self.reduce_bucket // 10:
                self._step_pieces(self._ready)
                self._ready, self._ready_elems = [], 0
        return run

    def _step_pieces(self, params: List[torch.nn.Parameter]) -> None:
        """One inner-optimizer step over just these pieces (the others' grads are hidden),
        then their updated values into the host shards."""
        prescale = 1.0 / self.grad_divisor
        pieces = []
        for p in params:
            pc, g = self.piece[id(p)], self.grad_of[id(p)]
            if prescale != 1.0:
                g.mul_(prescale)
            pc.grad = g
            pieces.append(pc)
        self._inner.step()
        for pc in pieces:
            pc.grad = None
        self._stepped.update(id(p) for p in params)
        if self.offload_param:
            with torch.no_grad():
                for p in params:
                    p.sw_meta.shard[:self.piece[id(p)].numel()].copy_(self.piece[id(p)])

    def after_backward(self, boundary: bool) -> None:
        self._drain()
        self.coordinator.sweep(keep=self._kept_for_next_forward())
        self.whole.after_backward(boundary)

    # --- step -----------------------------------------------------------------------------
    def master_grads(self) -> List[torch.Tensor]:
        self._drain()
        # a delayed step reads the gradients in the background, after waiting for their last
        # copies itself (_delayed_step): the boundary does not wait for the copy stream's tail
        # unless the loss scaler's overflow check must read them now
        if not self._grads_in_flight():
            self._acc.wait()
        for pid, g in self.grad_of.items():
            if pid not in self._written:
                g.zero_()  # no gradient in this window (a skipped module)
                self._written.add(pid)
        return [g for g in self.flat_grad if g.numel()] + self.whole.master_grads()

    def grad_norms(self, grads: List[torch.Tensor], in_order: bool = True) -> List[torch.Tensor]:
        """Host partitions: the norms the worker took as each gradient became final (a
        parameter that got no gradient on the boundary micro step is measured here).
        Out of order, their total is summed on the copy stream, behind the last copies."""
        if not self.offload_opt:
            return super().grad_norms(grads)
        n_host = sum(1 for g in self.flat_grad if g.numel())
        rest_ids = [pid for pid in self.grad_of if pid not in self._final]
        if rest_ids and self._grads_in_flight():
            self._acc.wait()  # a parameter without a boundary gradient is measured on the host
        rest = sum(float(torch.dot(self.grad_of[pid], self.grad_of[pid])) for pid in rest_ids)
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
        if self._eager_window:
            # the worker stepped the pieces whose gradient was final during backward (with
            # the same factor: 1/DP divisor); step the rest, then the persistent parameters
            self._acc.wait()
            rest = [p for params in self.trainable for p in params
                    if id(p) in self.piece and id(p) not in self._stepped]
            if rest:
                self._step_pieces(rest)
            self._restore_hidden(pieces=False)
            self.whole.optimizer_step(inner, factor)
            self._restore_hidden(pieces=True)
            return
        self._delayed_now = self._next_step_delayed()
        self.steps_done += 1
        if factor is not None and not self._delayed_now:
            for g in self.flat_grad:
                if g.numel():
                    g.mul_(factor.to(g.device))
        if not self._delayed_now:
            if self.delayed:
                self._attach_piece_grads(self.grad_of)
            # scales the persistent parameters' gradients too, then runs inner.step() once
            self.whole.optimizer_step(inner, factor)
            return
        self._delayed_step(inner, factor)

    # --- delayed parameter update (DPU) ----------------------------------------------------
    def _delayed_step(self, inner: torch.optim.Optimizer, factor: Optional[torch.Tensor]) -> None:
        """Step t's update starts in the background and reaches the weights at step t+1's
        boundary, so the CPU work overlaps step t+1's forward and backward: with masters w
        and the weights the model computes with p, ``w[t+1] = w[t] - u(g(p[t]))`` where
        ``p[t] = w[t-1]`` (ZeRO-Offload, section 4.3). Every parameter is one step stale,
        persistent ones included: their (small) device step runs here, but their weights are
        written only when the partitioned ones are."""
        self._apply_delayed()  # the update of step t-1 into the weights: they become w[t]
        self._attach_piece_grads(None)
        self.whole.optimizer_step(inner, factor)  # persistent masters only (pieces have no grad)
        self._attach_piece_grads(self.grad_of)
        self._bg_hidden = [(m, m.grad) for group in self.whole.master_param_groups()
                           for m in group]
        for m, _ in self._bg_hidden:
            m.grad = None
        # the scheduler changes the rates as soon as the engine's step returns: a snapshot
        step = detached_step(inner)
        grads = [g for g in self.flat_grad if g.numel()]
        writes = [(self.piece[pid], spare) for pid, spare in self._spare_shards.items()]
        grads_ready = self._acc.fence()
        factor_ready = None
        if factor is not None and factor.device.type == "cuda":
            factor_ready = torch.cuda.Event()
            factor_ready.record(torch.cuda.current_stream(factor.device))

        def background() -> None:
            # waiting for the last gradient copies, reading the factor (which may depend on
            # the norm), the multiply and the write into the spare shards all block or pass
            # over the whole model: here they overlap the next window, not the boundary
            grads_ready()
            if factor is not None:
                if factor_ready is not None:
                    factor_ready.synchronize()
                scale = factor.to(self.master_device)
                for g in grads:
                    g.mul_(scale)
            step()
            with torch.no_grad():
                for piece, spare in writes:
                    spare[:piece.numel()].copy_(piece)
        self._bg = self._bg_pool.submit(background)
        # the next window accumulates into the other partitions while this one is stepped
        spare_flat, spare_of = self._spare_grads
        self._spare_grads = (self.flat_grad, self.grad_of)
        self.flat_grad, self.grad_of = spare_flat, spare_of

    def _next_step_delayed(self) -> bool:
        return self.delayed and self.steps_done >= self.delay_warmup

    def _grads_in_flight(self) -> bool:
        """Between master_grads and the step: the boundary's last gradient copies are left in
        flight for the delayed step to wait for."""
        return self._next_step_delayed() and not self._fp16

    def _attach_piece_grads(self, grad_of: Optional[Dict[int, torch.Tensor]]) -> None:
        for pid, piece in self.piece.items():
            piece.grad = None if grad_of is None else grad_of[pid]

    def _apply_delayed(self) -> None:
        """Finish the background step and write its result into the weights."""
        if self._bg is None:
            return
        bg, self._bg = self._bg, None
        bg.result()
        for m, g in self._bg_hidden:
            m.grad = g
        self._bg_hidden = []
        self._attach_piece_grads(None)
        if self._spare_shards:
            self._swap_shards()
        else:
            self._write_shards(skip=set())
        self.whole.after_step(True)

    def _before_shard_write(self) -> None:
        """Before the shards change: nothing kept gathered may outlive the weights it copies,
        and no copy to the device may still read a host shard being overwritten."""
        self.coordinator.sweep()
        if self.offload_param:
            P.sync_fetches()

    def _swap_shards(self) -> None:
        """The shards the background step wrote become the weights; the others (no copy to
        the device may still read them) receive the next background step's result."""
        self._before_shard_write()
        for params in self.trainable:
            for p in params:
                spare = self._spare_shards.get(id(p))
                if spare is not None:
                    meta = p.sw_meta
                    meta.shard, self._spare_shards[id(p)] = spare, meta.shard

    def bind_optimizer(self, inner: torch.optim.Optimizer) -> None:
        self._inner = inner
        self.whole.bind_optimizer(inner)

    def _restore_hidden(self, pieces: bool) -> None:
        """Give the gradients hidden for the eager window back (persistent masters first,
        the pieces once the persistent step is done)."""
        piece_ids = {id(pc) for pc in self.piece.values()}
        keep = []
        for m, g in self._hidden:
            if (id(m) in piece_ids) == pieces:
                m.grad = g
            else:
                keep.append((m, g))
        self._hidden = keep
        if pieces:
            self._eager_window = False

    def flush(self) -> None:
        """Bring a pending delayed update into the weights (before saving or evaluating)."""
        self._apply_delayed()
        self.whole.flush()

    def after_step(self, applied: bool) -> None:
        if not applied:
            return
        if self._delayed_now:
            self.coordinator.sweep()
            return  # written at the next boundary (or by flush), one step late by design
        self._acc.wait()
        self._write_shards(skip=self._stepped if self.offload_param else set())
        self._stepped = set()
        self.whole.after_step(applied)

    def _write_shards(self, skip: Set[int]) -> None:
        """The updated masters into the compute-dtype shards (but those in ``skip``, which an
        eager step already wrote)."""
        self._before_shard_write()
        with torch.no_grad():
            for params in self.trainable:
                for p in params:
                    piece = self.piece.get(id(p))
                    if piece is not None and id(p) not in skip:
                        p.sw_meta.shard[:piece.numel()].copy_(piece, non_blocking=True)
        if self.offload_opt and not self.offload_param and self.device.type == "cuda":
            # the shards were DMA'd from the pinned masters, which the next CPU step rewrites
            torch.cuda.current_stream(self.device).synchronize()

    def zero_grads(self) -> None:
        if self._eager_window:
            self._acc.wait()
            self._restore_hidden(pieces=False)
            self._restore_hidden(pieces=True)
        # nothing to clear: each partition's first gradient of the next window overwrites it
        # (master_grads zeroes those that get none); the copy stream runs in order, so the
        # next window's copies follow a delayed step's still in flight
        if not self._delayed_now:
            self._acc.wait()
        self._written = set()
        for params in self.trainable:
            for p in params:
                p.grad = None
        self.whole.zero_grads()

    # --- checkpoint contract -------------------------------------------------------------
    def shard_views(self) -> List[ShardView]:
        self.flush()
        views = []
        for p in [p for params in self.trainable for p in params] + self.frozen_parts:
            meta = p.sw_meta
            views.append(ShardView(name=self.names[id(p)], param=p, global_shape=meta.shape,
                                   start=meta.own_lo, end=meta.own_hi,
                                   weight=meta.shard[:meta.own_len], master=self.piece.get(id(p))))
        return views + self.whole.shard_views()

    def refresh_after_load(self, weights_only: bool = False) -> None:
        self.flush()
        self._acc.wait()
        self.coordinator.sweep()
        if self.offload_param:
            P.sync_fetches()
        with torch.no_grad():
            for params in self.trainable:
                for p in params:
                    piece = self.piece.get(id(p))
                    if piece is None:
                        continue
                    own = p.sw_meta.shard[:piece.numel()]
                    if weights_only:
                        piece.copy_(own)
                    else:
                        own.copy_(piece)
        self.whole.refresh_after_load(weights_only)

    def no_sync_allowed(self) -> Optional[str]:
        return ("ZeRO stage 3 reduce-scatters gradients during backward; use "
                "gradient_accumulation_steps instead of no_sync()")

    # --- GatheredParameters(modifier_rank=...) support ---------------------------------
    def _refresh_master(self, p: torch.nn.Parameter) -> None:
        piece = self.piece.get(id(p))
        if piece is None:
            return
        with torch.no_grad():
            own = p.sw_meta.shard[:piece.numel()]
            if self._bg is not None:
                # a delayed update is still pending: it reaches every weight first (it would
                # otherwise overwrite the edit at the next boundary), then the edit wins
                edited = own.clone()
                self.flush()
                own = p.sw_meta.shard[:piece.numel()]  # the shards may have been swapped
                own.copy_(edited)
            piece.copy_(own)

    def _refresh_whole(self, p: torch.nn.Parameter) -> None:
        bucket, slot = self.whole._slot_of[p]
        if slot.master is not None and slot.master.data_ptr() != p.data.data_ptr():
            with torch.no_grad():
                slot.master.copy_(p.data.reshape(-1)[slot.own_lo:slot.own_hi])

    # --- state_dict ---------------------------------------------------------------------
    def _state_dict_hook(self, module: torch.nn.Module, state_dict, prefix: str, local_metadata):
        gathered = all(p.sw_meta.status == P.GATHERED for p in module._parameters.values()
                       if p is not None and P.is_partitioned(p))
        if self.world > 1 and not self.gather_on_save and not gathered:
            raise ZeroError(
                "state_dict() under ZeRO stage 3 with world size "
                f"{self.world}: the parameters are partitioned and "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save is false, so the "
                "full weights are not gathered. Set it to true (every rank must then call "
                "state_dict() together), read them inside `with shardwise.zero."
                "GatheredParameters(engine.module.parameters()):`, use engine.save_16bit_model(), "
                "or save with engine.save_checkpoint() and run `shardwise convert`.")
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or not P.is_partitioned(p) or key not in state_dict:
                continue
            meta = p.sw_meta
            meta.active += 1
            P.gather([p])
            state_dict[key] = p.detach().clone()
            meta.active -= 1
            if meta.active == 0:
                P.release(p)
        return state_dict

    def _load_pre_hook(self, module: torch.nn.Module, state_dict, prefix: str, *args) -> None:
        """``load_state_dict``: gather the module's parameters so torch copies into full views
        (all ranks call it together; one module at a time is gathered)."""
        loading = [p for name, p in module._parameters.items()
                   if p is not None and prefix + name in state_dict]
        parts = [p for p in loading if P.is_partitioned(p)]
        for p in parts:
            p.sw_meta.active += 1
        P.gather(parts)
        module.__dict__["_sw_loading"] = loading

    def _load_post_hook(self, module: torch.nn.Module, incompatible_keys) -> None:
        """Keep this rank's chunk of the loaded values and refresh the fp32 masters."""
        for p in module.__dict__.pop("_sw_loading", []):
            if not P.is_partitioned(p):
                if getattr(p, "_sw_on_modified", None) is not None:
                    p._sw_on_modified(p)  # a whole parameter: its fp32 master slice
                continue
            meta = p.sw_meta
            P.write_full_(p, p.data)
            if meta.on_modified is not None:
                meta.on_modified(p)
            meta.active = max(0, meta.active - 1)
            if meta.active == 0:
                P.release(p)

    def remove_hooks(self) -> None:
        self.flush()
        if self._bg_pool is not None:
            self._bg_pool.shutdown(wait=True)
        self._acc.close()
        for h in self._grad_hooks + self._sd_hooks:
            h.remove()
        self.coordinator.remove()
        self.whole.remove_hooks()

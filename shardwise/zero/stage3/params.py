"""Stage-3 parameter placement: partition, gather around each module, release after.

:class:`Stage3Params` is everything of ZeRO stage 3 that does not need an optimizer, so it is
also the *parameters-only* stage 3 that ``initialize`` builds without one (DeepSpeed's
ZeRO-Inference route): large parameters keep only this rank's chunk (on the accelerator, or
in host memory under ``offload_param``), small ones (fewer than
``param_persistence_threshold`` elements, within ``model_persistence_threshold``) stay whole;
the hooks of ``hooks.ParamCoordinator`` gather each module's shards just before it runs and
release them after. ``state_dict()`` / ``load_state_dict()`` gather one module at a time.

The training strategy (``strategy.py``) composes it with gradient reduction and the
optimizer's masters.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ...errors import ConfigError, ZeroError
from ...utils.logging import log_dist
from ..shard_view import ShardView
from .partition import GATHERED, Partitioner, PartitionedParam, group_info, record_of


def refuse_nvme(zero) -> None:
    oo = zero.offload_optimizer
    if zero.offload_param_device == "nvme" and oo is not None and oo.delayed_update:
        raise ConfigError("zero_optimization.offload_optimizer.delayed_update with offload_param "
                          "device \"nvme\" is not supported (the delayed update keeps a second "
                          "set of parameter shards in host memory, which NVMe offload exists to "
                          "avoid); drop delayed_update or use offload_param device \"cpu\"")


def _swapper(config, rank: int, training: bool):
    """offload_param on NVMe: the swap files and read buffers of this engine (None otherwise)."""
    if config.zero_optimization.offload_param_device != "nvme":
        return None
    from .file_shard import ParamSwapper
    return ParamSwapper.from_config(config, rank, training)


class Stage3Params:
    """Partitions ``module``'s parameters for one engine and gathers them around each use."""

    def __init__(self, *, config, module: torch.nn.Module, group: Optional[dist.ProcessGroup],
                 device: torch.device, training: bool = True) -> None:
        zero = config.zero_optimization
        refuse_nvme(zero)
        self.module = module
        self.device = torch.device(device)
        self.world, self.rank = group_info(group)
        self.compute_dtype = (config.compute_dtype if not config.torch_autocast.enabled
                              else torch.float32)
        self.offload = zero.offload_param_device in ("cpu", "nvme")
        self.gather_on_save = bool(zero.gather_16bit_weights_on_model_save)
        self.swapper = _swapper(config, self.rank, training)
        """``offload_param`` on NVMe (``file_shard.ParamSwapper``); None otherwise."""
        self.partitioner = Partitioner(
            group=group, shard_device=torch.device("cpu") if self.offload else self.device,
            compute_device=self.device,
            pin=bool(self.offload and zero.offload_param.pin_memory), swapper=self.swapper)
        self.gathers = self.partitioner.gathers
        self.names: Dict[int, str] = {}
        try:
            self.persistent = self._place(int(zero.param_persistence_threshold),
                                          int(zero.model_persistence_threshold))
        except BaseException:
            if self.swapper is not None:
                self.swapper.close()
            raise
        # placeholders, whole parameters and buffers to the compute device and dtype
        module.to(device=self.device, dtype=self.compute_dtype)
        self.coordinator = _coordinator(module, self.partitioner, zero)
        self._loading: Dict[int, List[torch.nn.Parameter]] = {}
        """Per module (id) in ``load_state_dict``: the parameters its pre-hook gathered."""
        self._sd_hooks = self._install_state_dict_hooks(module)
        n_part = sum(1 for _ in self.partitioner.records())
        log_dist(f"ZeRO stage 3: {n_part} partitioned parameters over {self.world} ranks, "
                 f"{sum(self.persistent.values())} persistent; params on "
                 f"{self.partitioner.shard_device}", ranks=[0])
        if self.swapper is not None:
            sw = self.swapper
            log_dist(f"ZeRO stage 3: {sw.on_nvme} parameter partitions "
                     f"({sw.nvme_bytes / 2**30:.2f} GiB per rank) in swap files under {sw.path}; "
                     f"{n_part - sw.on_nvme} in host memory ({sw.in_cpu} by max_in_cpu, the "
                     f"others under min_nvme_bytes)", ranks=[0])

    def _place(self, threshold: int, budget: int) -> Dict[int, bool]:
        """Decide which parameters stay whole; partition (or adopt) the others."""
        persistent: Dict[int, bool] = {}
        for name, p in self.module.named_parameters():
            self.names[id(p)] = name
            rec = record_of(p)
            numel = rec.numel if rec is not None else p.numel()
            keep = numel < threshold and budget - numel >= 0
            if keep:
                budget -= numel
            persistent[id(p)] = keep
            if keep and rec is not None:
                self.partitioner.unpartition(p)
            elif not keep:
                self.partitioner.partition(p, dtype=self.compute_dtype)
        return persistent

    def record(self, p: torch.nn.Parameter) -> Optional[PartitionedParam]:
        return self.partitioner.record(p)

    # --- parameters-only engine contract ----------------------------------------------------
    def shard_views(self, params: Optional[List[torch.nn.Parameter]] = None) -> List[ShardView]:
        """This rank's piece of each partitioned parameter (no masters: nothing is trained)."""
        views = []
        for p in params if params is not None else [r.param for r in self.partitioner.records()]:
            rec = self.record(p)
            views.append(ShardView(name=self.names[id(p)], param=p, global_shape=rec.shape,
                                   start=rec.own_lo, end=rec.own_hi,
                                   weight=rec.shard[:rec.own_len], master=None))
        return views

    def before_shard_write(self) -> None:
        """Before the shards change: nothing kept gathered may outlive the weights it copies,
        and no copy to the device may still read a host shard being overwritten."""
        self.gathers.sweep()
        if self.offload:
            self.gathers.sync_fetches()
        if self.swapper is not None:
            self.swapper.commit_held()  # in-place edits of shard copies (checkpoint loads)

    def flush(self) -> None:
        """Nothing deferred without an optimizer."""

    def refresh_after_load(self, weights_only: bool = False) -> None:
        """A checkpoint wrote into the shards: nothing gathered may keep the old values."""
        self.before_shard_write()

    def no_sync_allowed(self) -> Optional[str]:
        return ("no_sync() is incompatible with ZeRO stage 3 (gradients are reduce-scattered "
                "during backward); use gradient_accumulation_steps instead")

    def remove_hooks(self) -> None:
        for h in self._sd_hooks:
            h.remove()
        self._sd_hooks = []
        self.coordinator.remove()
        if self.swapper is not None:
            self.swapper.close()  # the swap files go with the engine

    # --- state_dict ---------------------------------------------------------------------
    def _install_state_dict_hooks(self, module: torch.nn.Module) -> list:
        hooks = []
        for m in module.modules():
            own = [p for p in m._parameters.values() if p is not None]
            if any(self.record(p) is not None for p in own):
                hooks.append(m._register_state_dict_hook(self._state_dict_hook))
            if own:
                hooks += [m._register_load_state_dict_pre_hook(self._load_pre_hook,
                                                               with_module=True),
                          m.register_load_state_dict_post_hook(self._load_post_hook)]
        return hooks

    def _state_dict_hook(self, module: torch.nn.Module, state_dict, prefix: str, local_metadata):
        recs = {name: self.record(p) for name, p in module._parameters.items() if p is not None}
        recs = {name: rec for name, rec in recs.items() if rec is not None}
        gathered = all(rec.status == GATHERED for rec in recs.values())
        if self.world > 1 and not self.gather_on_save and not gathered:
            raise ZeroError(
                "state_dict() under ZeRO stage 3 with world size "
                f"{self.world}: the parameters are partitioned and "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save is false, so the "
                "full weights are not gathered. Set it to true (every rank must then call "
                "state_dict() together), read them inside `with shardwise.zero."
                "GatheredParameters(engine.module.parameters()):`, use engine.save_16bit_model(), "
                "or save with engine.save_checkpoint() and run `shardwise convert`.")
        for name, rec in recs.items():
            key = prefix + name
            if key not in state_dict:
                continue
            rec.active += 1
            self.gathers.gather([rec])
            state_dict[key] = rec.param.detach().clone()
            rec.active -= 1
            if rec.active == 0:
                self.gathers.release(rec)
        return state_dict

    def _load_pre_hook(self, module: torch.nn.Module, state_dict, prefix: str, *args) -> None:
        """``load_state_dict``: gather the module's parameters so torch copies into full views
        (all ranks call it together; one module at a time is gathered)."""
        loading = [p for name, p in module._parameters.items()
                   if p is not None and prefix + name in state_dict]
        recs = [rec for rec in map(self.record, loading) if rec is not None]
        for rec in recs:
            rec.active += 1
        self.gathers.gather(recs)
        self._loading[id(module)] = loading

    def _load_post_hook(self, module: torch.nn.Module, incompatible_keys) -> None:
        """Keep this rank's chunk of the loaded values and refresh the fp32 masters."""
        for p in self._loading.pop(id(module), []):
            rec = self.record(p)
            if rec is None:
                on_modified = self.partitioner.whole_modified(p)
                if on_modified is not None:
                    on_modified(p)  # a whole parameter: its fp32 master slice
                continue
            self.gathers.write_shard(rec, p.data)
            if rec.on_modified is not None:
                rec.on_modified(p)
            rec.active = max(0, rec.active - 1)
            if rec.active == 0:
                self.gathers.release(rec)


def _coordinator(module: torch.nn.Module, partitioner: Partitioner, zero):
    from .hooks import ParamCoordinator
    return ParamCoordinator(module, partitioner, prefetch_elems=int(zero.prefetch_bucket_size),
                            max_live=int(zero.max_live_parameters),
                            max_reuse=int(zero.max_reuse_distance))



"""DeepSpeed's engine methods beyond forward/backward/step, on the shardwise engine.

``ShardwiseEngine`` inherits ``DeepSpeedCompatMixin``: the batch-size setters, the manual
accumulation boundary, ``get_mom``, ``deepspeed_io``, ``empty_partition_cache``, module
state-dict helpers and the attributes DeepSpeed scripts read (``dp_world_size``, ``mpu`` ...).
The config queries live in deepspeed_queries.py, the names shardwise does not implement in
deepspeed_unsupported.py; docs/engine_api.md lists the whole surface with each name's status.
"""
from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..accelerator import get_accelerator
from ..errors import ConfigError, UnsupportedFeatureError
from .deepspeed_queries import DeepSpeedQueriesMixin
from .deepspeed_unsupported import UnsupportedSurfaceMixin

if TYPE_CHECKING:
    from ..config import ShardwiseConfig

#: deepspeed_io's routes (DeepSpeed's ROUTE_* constants): only "train" shuffles.
ROUTES = ("train", "eval", "predict", "encode")
#: DeepSpeed's get_mom: these optimizers report "momentum", every other one "betas".
_MOMENTUM_OPTIMIZERS = ("sgd", "rmsprop")


class DeepSpeedCompatMixin(DeepSpeedQueriesMixin, UnsupportedSurfaceMixin):
    """The rest of ``DeepSpeedEngine``'s public surface. The engine provides ``config``,
    ``optimizer``, ``strategy``, ``module``, ``world_size``, ``global_rank``, ``dp_group`` and
    ``loss_scaler``, and calls ``_init_deepspeed_compat()`` in its constructor."""

    config: "ShardwiseConfig"

    def _init_deepspeed_compat(self) -> None:
        self._boundary_override: Optional[bool] = None
        """Set by set_gradient_accumulation_boundary(); None: the micro-step counter decides."""
        self.collate_fn: Optional[Callable] = None
        """deepspeed_io's default collate_fn (DeepSpeed keeps initialize()'s here)."""

    # --- batch geometry --------------------------------------------------------------------
    def get_batch_info(self) -> Tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return (int(self.config.train_batch_size), int(self.config.train_micro_batch_size_per_gpu),
                int(self.config.gradient_accumulation_steps))

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing gradient_accumulation_steps; the micro batch
        stays (DeepSpeed's rule). Not divisible by micro batch x world size: ``ConfigError``."""
        micro = int(self.config.train_micro_batch_size_per_gpu)
        per_step = micro * self.world_size
        if (isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int)
                or train_batch_size < 1 or train_batch_size % per_step):
            raise ConfigError(
                f"set_train_batch_size({train_batch_size!r}): the global batch must be a positive "
                f"multiple of train_micro_batch_size_per_gpu x world_size = {micro} x "
                f"{self.world_size} = {per_step} (the micro batch is kept and "
                f"gradient_accumulation_steps changes); e.g. {per_step * 2}.")
        self.config.gradient_accumulation_steps = train_batch_size // per_step
        self.config.train_batch_size = train_batch_size
        self._batch_changed()

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch, keeping gradient_accumulation_steps (DeepSpeed's rule); the
        global batch follows. Loaders built earlier keep their batch size."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) \
                or micro_batch_size < 1:
            raise ConfigError(f"set_train_micro_batch_size({micro_batch_size!r}): the micro batch "
                              "must be a positive int, e.g. 4.")
        ga = int(self.config.gradient_accumulation_steps)
        self.config.train_micro_batch_size_per_gpu = micro_batch_size
        self.config.train_batch_size = micro_batch_size * ga * self.world_size
        self._batch_changed()

    def _batch_changed(self) -> None:
        logger = getattr(self, "step_logger", None)
        if logger is not None and hasattr(logger, "samples_per_step"):
            logger.samples_per_step = int(self.config.train_batch_size)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say yourself whether the next backward/step is the accumulation boundary (set it
        before each forward/backward; True on the last micro batch, then call ``step()``
        once). ``None`` gives the decision back to the micro-step counter."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary() takes True, False or None, got "
                            f"{type(is_boundary).__name__} {is_boundary!r}")
        self._boundary_override = is_boundary

    # --- optimizer queries ---------------------------------------------------------------------
    def _group_values(self, key: str) -> List[Any]:
        if getattr(self, "optimizer", None) is None:
            return []
        return [group.get(key, 0.0) for group in self.optimizer.param_groups]

    def get_mom(self) -> List[Any]:
        """Per param group: ``momentum`` for SGD/RMSprop, else ``betas`` (DeepSpeed's rule)."""
        name = (self.optimizer_name() or "").lower()
        return self._group_values("momentum" if name in _MOMENTUM_OPTIMIZERS else "betas")

    def get_type(self) -> List[Any]:
        """Per param group, its "type" entry (0.0 when absent), as DeepSpeed returns it."""
        return self._group_values("type")

    # --- data --------------------------------------------------------------------------------
    def deepspeed_io(self, dataset: Any, batch_size: Optional[int] = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None,
                     collate_fn: Optional[Callable] = None,
                     num_local_io_workers: Optional[int] = None) -> Any:
        """A loader of this rank's micro batches: a ``DistributedSampler`` over the data-parallel
        ranks (shuffled for the "train" route, in order for "eval"/"predict"), batches of
        ``train_micro_batch_size_per_gpu`` unless ``batch_size`` is given. An iterable dataset
        is batched as it comes (it shards itself); a ``data_sampler`` replaces the sampler."""
        from .dataloader import ShardwiseDataLoader
        if route not in ROUTES:
            raise ConfigError(f"deepspeed_io(route={route!r}): route must be one of {ROUTES}")
        iterable = self.is_iterable_style_dataset(dataset)
        if not (iterable or self.is_map_style_dataset(dataset)):
            raise ConfigError(f"deepspeed_io(): the dataset must be a torch Dataset (map-style with "
                              f"__getitem__ and __len__, or an IterableDataset); got "
                              f"{type(dataset).__name__}")
        batch = int(batch_size or self.train_micro_batch_size_per_gpu())
        collate = collate_fn if collate_fn is not None else self.collate_fn
        drop_last = self.dataloader_drop_last()
        pin = bool(pin_memory) and get_accelerator().kind == "cuda"
        workers = 0 if num_local_io_workers is None else int(num_local_io_workers)
        if iterable or data_sampler is not None:
            return DataLoader(dataset, batch_size=batch, sampler=data_sampler, collate_fn=collate,
                              num_workers=workers, pin_memory=pin, drop_last=drop_last)
        return ShardwiseDataLoader(dataset, batch_size=batch, rank=self._dp_rank(),
                                   world_size=self.world_size, collate_fn=collate,
                                   num_workers=num_local_io_workers, pin_memory=pin,
                                   seed=int(self.config.seed or 0), shuffle=route == "train",
                                   drop_last=drop_last)

    def _dp_rank(self) -> int:
        if not dist.is_initialized():
            return 0
        return dist.get_rank(self.dp_group) if self.dp_group is not None else dist.get_rank()

    def get_data_parallel_rank(self) -> int:
        return self._dp_rank()

    # --- stage 3 memory ----------------------------------------------------------------------
    def empty_partition_cache(self) -> None:
        """Release every gathered stage-3 parameter that no forward is using, then give the
        allocator's cache back (DeepSpeed's ``empty_partition_cache``). Below stage 3 nothing
        is gathered, so only the cache is emptied. Not collective."""
        coordinator = getattr(self.strategy, "coordinator", None)
        if coordinator is not None:
            coordinator.sweep()
        gc.collect()
        get_accelerator().empty_cache()

    # --- module weights ----------------------------------------------------------------------
    def save_fp16_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's old name of ``save_16bit_model`` (same file name default as DeepSpeed)."""
        return self.save_16bit_model(save_dir, save_filename=save_filename)

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> Dict[str, Any]:
        """``module.state_dict()``, optionally without frozen parameters. Under stage 3 call it
        inside ``shardwise.zero.GatheredParameters`` (or use ``save_16bit_model``)."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters(prefix=prefix.rstrip(".")):
                if not p.requires_grad:
                    state.pop(name, None)
        return state

    def load_module_state_dict(self, checkpoint: Dict[str, Any], strict: bool = True,
                               custom_load_fn: Optional[Callable] = None,
                               fetch_z3_params: bool = False) -> None:
        """Load module weights (``checkpoint["module"]``, or ``checkpoint`` itself when it is a
        plain state dict) and refresh the fp32 master copies from them."""
        state = checkpoint.get("module", checkpoint) if isinstance(checkpoint, dict) else checkpoint
        if custom_load_fn is not None:
            custom_load_fn(src=state, dst=self.module)
        else:
            self.module.load_state_dict(state, strict=strict)
        if self.strategy is not None:
            self.strategy.refresh_after_load(weights_only=True)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> Optional[Dict[str, torch.Tensor]]:
        """The whole module's weights (compute dtype) and persistent buffers on the CPU, keyed as
        ``module.state_dict()``, on rank 0; None on the other ranks. DeepSpeed's private method,
        which Accelerate and the Hugging Face Trainer call to save a ZeRO-3 model; every rank
        must call it (under stage 3 the partitions are gathered to rank 0)."""
        from ..checkpoint import engine_io
        from ..checkpoint.engine_state import _aliases, _persistent_buffers, _stage
        engine_io._async.wait_pending(self)
        stage = _stage(self)
        views = {v.name: v for v in engine_io._views(self)}
        state: Dict[str, torch.Tensor] = {}
        for name, p in self.module.named_parameters():
            if exclude_frozen_parameters and not p.requires_grad:
                continue
            state[name] = engine_io._gather_full(self, name, p, views.get(name), stage)
        if self.global_rank != 0:
            return None
        for first, others in _aliases(self.module).items():
            for other in others:
                if first in state:
                    state[other] = state[first]
        for name, buf in _persistent_buffers(self.module):
            state[name] = buf.detach().cpu()
        return state

    # --- attributes DeepSpeed scripts read ------------------------------------------------------
    @property
    def dp_world_size(self) -> int:
        return int(self.world_size)

    @property
    def mp_world_size(self) -> int:
        return 1

    @property
    def sequence_parallel_size(self) -> int:
        return 1

    @property
    def data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The data-parallel process group (None: the default group, all ranks)."""
        return self.dp_group

    @property
    def mpu(self) -> None:
        return None  # no model parallelism

    @property
    def progressive_layer_drop(self) -> None:
        return None

    @property
    def gradient_average(self) -> bool:
        return True  # reduced gradients are averaged over the data-parallel ranks

    @property
    def enable_backward_allreduce(self) -> bool:
        return True

    @property
    def basic_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer the engine steps (``engine.optimizer`` wraps it)."""
        wrapped = getattr(self, "optimizer", None)
        return getattr(wrapped, "inner", wrapped)

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in (DeepSpeed's property): communication_data_type
        when set, else the gradient accumulation dtype (fp32 by default; stage 3 reduces in
        fp32)."""
        if self.config.communication_dtype is not None:
            return self.config.communication_dtype
        if self.config.zero_optimization.stage >= 3:
            return torch.float32
        return self.get_data_types()[1]

    @communication_data_type.setter
    def communication_data_type(self, value: Any) -> None:
        raise UnsupportedFeatureError(
            f"setting engine.communication_data_type (to {value!r}) is not supported in "
            "shardwise: the ZeRO buckets are built for the configured dtype at initialize. "
            "Instead: set \"communication_data_type\" in the config.")

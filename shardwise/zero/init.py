"""``zero.Init`` (build a model already partitioned) and ``zero.GatheredParameters``.

``Init`` as a context partitions every module's parameters as soon as the module is built:
the ``__init__`` of every ``nn.Module`` subclass is wrapped for the duration of the context
(DeepSpeed does the same), and when the outermost ``__init__`` of a module returns, its
parameters, fully initialised, are split and only this rank's chunk is kept. So the full
model never exists in one process: a ``ModuleList([Block() for _ in range(n)])`` holds
partitioned blocks, the peak is about one module at full size plus this rank's
partitions. Random initialisation consumes the generator exactly as an unpartitioned build
does, so the same seed gives the same model on every rank and at every world size.

``nn.Module.apply`` is patched inside the context (DeepSpeed's ``override_module_apply``):
``model.apply(init_fn)`` gathers each module's own parameters around ``init_fn`` and keeps
the modified values. Other writes to a parameter of an already-attached module inside the
constructor (``nn.init.zeros_(self.fc.bias)`` in a parent's ``__init__``) see an empty
tensor and have no effect, as under DeepSpeed; wrap them in ``GatheredParameters``.

Hugging Face models initialise their weights at the end of the top-level ``__init__``
(``post_init``), after their submodules were partitioned; transformers 5.x walks the modules
with its own ``smart_apply`` rather than ``nn.Module.apply``. So inside the context the
``_initialize_weights(module)`` method of every class that defines one runs with ``module``'s
own parameters and its direct children's gathered, and keeps what it wrote: the generator is
consumed as without ``zero.Init``, and the same seed gives the same model.
"""
from __future__ import annotations

import functools
import json
import weakref
from pathlib import Path
from typing import Any, Iterable, List, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.modules import module as _module_mod

from .. import comm
from ..comm.topology import global_rank, group_world_rank
from ..errors import ConfigError, ZeroError
from ..utils.logging import log_dist
from .stage3 import partition as P


def _accel_device() -> torch.device:
    from ..accelerator import get_accelerator
    acc = get_accelerator()
    if acc.kind in ("cuda", "xpu"):
        import os
        return acc.device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _read_config(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"zero.Init(config_dict_or_path={str(config)!r}): no such file; pass "
                          "the ds_config dict or the path of an existing JSON file")
    try:
        from ..config.jsonc import loads as _loads  # comments/trailing commas, like the loader
        return _loads(path.read_text(encoding="utf-8"))
    except ImportError:  # pragma: no cover - the config package always has it
        return json.loads(path.read_text(encoding="utf-8"))


class Init:
    """Partition parameters at construction (context) or partition an existing module.

    Arguments follow ``deepspeed.zero.Init``; the ones without an effect here (``mpu``,
    ZeRO++ quantization, ``param_swapper``) are accepted for compatibility.
    """

    def __init__(self, module: Optional[torch.nn.Module] = None,
                 data_parallel_group: Optional[dist.ProcessGroup] = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: Optional[torch.dtype] = None, mpu: Any = None,
                 zero_param_parallel_group: Any = None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        self.enabled = enabled
        self.group = data_parallel_group
        raw = _read_config(config_dict_or_path if config_dict_or_path is not None else config)
        zero = raw.get("zero_optimization", {}) if isinstance(raw, dict) else {}
        offload = (zero.get("offload_param") or {}) if isinstance(zero, dict) else {}
        if remote_device is None:
            remote_device = offload.get("device")
            pin_memory = pin_memory or bool(offload.get("pin_memory", False))
        remote_device = (remote_device or "none").lower()
        if remote_device == "nvme":
            # the swap files belong to the engine (its nvme_path, its lifetime): partitions are
            # built in host memory here and initialize() moves them to the disk as it adopts them
            log_dist("zero.Init(remote_device=\"nvme\"): partitions are built in host memory; "
                     "initialize() moves them to the offload_param swap files", ranks=[0])
            # not pinned: page-locked memory stays cached by torch after the move to the disk
            remote_device, pin_memory = "cpu", False
        if remote_device not in ("none", "cpu"):
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}): expected None, "
                              "\"none\" or \"cpu\"")
        if dtype is None and isinstance(raw, dict):
            if (raw.get("bf16") or raw.get("bfloat16") or {}).get("enabled"):
                dtype = torch.bfloat16
            elif (raw.get("fp16") or {}).get("enabled"):
                dtype = torch.float16
        self.dtype = dtype
        self.pin = pin_memory
        self.compute_device = _accel_device()
        self.shard_device = torch.device("cpu") if remote_device == "cpu" else self.compute_device
        self._partitioner: Optional[P.Partitioner] = None
        self._handles: list = []
        self._touched: List[weakref.ref] = []
        self._orig_apply = None
        self._orig_init_subclass = None
        self._nested = False
        if module is not None and enabled:
            self._partition_module(module, recurse=True)

    # --- partitioning -----------------------------------------------------------------
    def _world(self) -> tuple:
        if not comm.is_initialized():
            comm.init_distributed(verbose=False)
        return P.group_info(self.group)

    def _partition_module(self, module: torch.nn.Module, recurse: bool) -> None:
        if self._partitioner is None:
            self._world()
            # this context's records until an engine adopts them
            self._partitioner = P.Partitioner(group=self.group, shard_device=self.shard_device,
                                              compute_device=self.compute_device, pin=self.pin)
        params = module.parameters() if recurse else module._parameters.values()
        for p in list(params):
            if p is None or P.is_partitioned(p) or p.device.type == "meta":
                continue
            self._partitioner.partition(p, dtype=self.dtype if p.is_floating_point() else None)

    def _on_param(self, module: torch.nn.Module, name: str, param: Any) -> None:
        self._touched.append(weakref.ref(module))

    def _wrap_init(self, cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or cls in _ORIG_INITS:
            return
        ctx = self

        @functools.wraps(orig)
        def __init__(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            # subclass __init__s call super().__init__(): act only when the outermost returns
            key = id(module)
            depth = _INIT_DEPTH.get(key, 0)
            _INIT_DEPTH[key] = depth + 1
            try:
                orig(module, *args, **kwargs)
            finally:
                if depth:
                    _INIT_DEPTH[key] = depth
                else:
                    _INIT_DEPTH.pop(key, None)
            if depth == 0:
                ctx._partition_module(module, recurse=True)

        _ORIG_INITS[cls] = orig
        cls.__init__ = __init__  # type: ignore[misc]

    def _wrap_weight_init(self, cls: type) -> None:
        """Hugging Face's per-module ``_initialize_weights(module, ...)``: run it on gathered
        parameters (the module's own and its direct children's, which some models' init
        writes) and keep the values it wrote."""
        orig = cls.__dict__.get("_initialize_weights")
        if orig is None or not callable(orig) or cls in _ORIG_WEIGHT_INITS:
            return

        @functools.wraps(orig)
        def _initialize_weights(model: torch.nn.Module, module: torch.nn.Module,
                                *args: Any, **kwargs: Any) -> Any:
            if getattr(module, "_is_hf_initialized", False):
                return orig(model, module, *args, **kwargs)
            params = list(module._parameters.values())
            for child in module.children():
                if not hasattr(child, "_initialize_weights"):  # a sub-model inits its own
                    params.extend(child._parameters.values())
            parts = list({id(p): p for p in params
                          if p is not None and P.is_partitioned(p)}.values())
            if not parts:
                return orig(model, module, *args, **kwargs)
            with GatheredParameters(parts, modifier_rank=0):
                return orig(model, module, *args, **kwargs)

        _ORIG_WEIGHT_INITS[cls] = orig
        cls._initialize_weights = _initialize_weights  # type: ignore[attr-defined]

    # --- context ------------------------------------------------------------------------
    def __enter__(self) -> "Init":
        if not self.enabled or _ACTIVE:
            self._nested = True  # an outer Init already partitions everything built here
            return self
        self._nested = False
        _ACTIVE.append(self)
        self._world()
        # every module class's __init__ ends by partitioning that module (DeepSpeed does the
        # same); classes defined inside the context are wrapped through __init_subclass__
        todo = list(torch.nn.Module.__subclasses__())
        while todo:
            cls = todo.pop()
            todo.extend(cls.__subclasses__())
            self._wrap_init(cls)
            self._wrap_weight_init(cls)
        self._orig_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        ctx = self

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            ctx._wrap_init(cls)
            ctx._wrap_weight_init(cls)

        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
        self._handles = [_module_mod.register_module_parameter_registration_hook(self._on_param)]
        self._orig_apply = torch.nn.Module.apply
        orig = self._orig_apply

        def apply(module: torch.nn.Module, fn):
            for child in module.children():
                child.apply(fn)
            own = [p for p in module._parameters.values() if p is not None and P.is_partitioned(p)]
            if not own:
                fn(module)
                return module
            with GatheredParameters(own, modifier_rank=0):
                fn(module)
            return module

        apply.__doc__ = orig.__doc__
        torch.nn.Module.apply = apply  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled or self._nested:
            return
        _ACTIVE.clear()
        for h in self._handles:
            h.remove()
        self._handles = []
        torch.nn.Module.apply = self._orig_apply  # type: ignore[assignment]
        if self._orig_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._orig_init_subclass  # type: ignore[assignment]
        for cls, orig in list(_ORIG_INITS.items()):
            cls.__init__ = orig  # type: ignore[misc]
        _ORIG_INITS.clear()
        for cls, orig in list(_ORIG_WEIGHT_INITS.items()):
            cls._initialize_weights = orig  # type: ignore[attr-defined]
        _ORIG_WEIGHT_INITS.clear()
        if exc[0] is None:
            # modules whose class escaped the wrapping (or that were built half-way) and the
            # parameters a parent registered after its children
            for ref in self._touched:
                m = ref()
                if m is not None:
                    self._partition_module(m, recurse=False)
        self._touched = []


_ORIG_INITS: dict = {}
_ORIG_WEIGHT_INITS: dict = {}
_INIT_DEPTH: dict = {}
_ACTIVE: list = []


class GatheredParameters:
    """Gather partitioned parameters for reading or modification.

    On entry every rank all-gathers the (partitioned) parameters in ``params`` (a Parameter
    or an iterable of them; others are ignored), each through the gather context of the
    engine (or ``zero.Init``) that holds it. On exit, if ``modifier_rank`` is set, that
    rank's values are broadcast, every rank keeps its chunk of them, and an engine built on
    the model updates its fp32 master copies. All ranks must enter together.
    ``fwd_module`` is accepted for DeepSpeed compatibility.
    """

    def __init__(self, params: Union[torch.nn.Parameter, Iterable[torch.nn.Parameter]],
                 modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.parts: List[tuple] = []
        """(gather context, record) of each partitioned parameter."""
        for p in self.params:
            owner = P.owner_of(p)
            rec = owner.record(p) if owner is not None else None
            if rec is not None:
                self.parts.append((owner.gathers, rec))

    def __enter__(self) -> None:
        if not self.enabled:
            return None
        for gathers, rec in self.parts:
            rec.active += 1
            gathers.start([rec])
        for gathers, rec in self.parts:
            gathers.wait(rec)
        return None

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc[0] is None:
                self._publish()
        finally:
            for gathers, rec in self.parts:
                rec.active = max(0, rec.active - 1)
                if rec.active == 0:
                    gathers.release(rec)

    def _publish(self) -> None:
        """Broadcast the modifier's values, keep this rank's chunk, refresh the masters."""
        for p in self.params:
            owner = P.owner_of(p)
            rec = owner.record(p) if owner is not None else None
            group = rec.group if rec is not None else None
            world, _ = group_world_rank(group)
            if world > 1:
                if not 0 <= self.modifier_rank < world:
                    raise ZeroError(f"GatheredParameters(modifier_rank={self.modifier_rank}): "
                                    f"the group has ranks 0..{world - 1}")
                src = global_rank(group, self.modifier_rank)
                with torch.no_grad():
                    comm.broadcast(p.data, src=src, group=group)
            if rec is not None:
                owner.gathers.write_shard(rec, p.data)
                if rec.on_modified is not None:
                    rec.on_modified(p)
            elif owner is not None and owner.whole_modified(p) is not None:
                owner.whole_modified(p)(p)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Tell stage 3 that ``module``'s forward uses ``parameter`` although another module owns
    it (e.g. ``F.linear(h, self.wte.weight)`` in a parent): it is gathered with ``module``."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise ZeroError(f"register_external_parameter: expected a Parameter, got "
                        f"{type(parameter).__name__}")
    ext = module.__dict__.setdefault("_sw_external_params", [])
    if all(p is not parameter for p in ext):
        ext.append(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    ext = module.__dict__.get("_sw_external_params", [])
    module.__dict__["_sw_external_params"] = [p for p in ext if p is not parameter]

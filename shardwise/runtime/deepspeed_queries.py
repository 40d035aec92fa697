"""DeepSpeed's engine query methods: what the config says, under DeepSpeed's method names.

``DeepSpeedEngine`` exposes most config values as methods (``engine.zero_reduce_bucket_size()``,
``engine.fp16_enabled()`` ...), and scripts and integrations branch on them. Each one here
reads the resolved ``ShardwiseConfig``. A query about a feature shardwise does not have
answers what is true here (``curriculum_learning_enabled()`` is False) rather than raising, so a
script's ``if engine.x_enabled():`` keeps working; the feature's own parameters raise (see
deepspeed_unsupported.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from ..config.base import torch_dtype_of

if TYPE_CHECKING:
    from ..config import ShardwiseConfig

#: DeepSpeed's default for torch_autocast.lower_precision_safe_modules.
_AUTOCAST_SAFE_MODULES = ["torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d",
                          "torch.nn.Conv3d"]


def _section_on(value: Any) -> bool:
    """A kept-verbatim DeepSpeed section counts as on when it is a dict with enabled true."""
    return isinstance(value, dict) and bool(value.get("enabled", False))


class DeepSpeedQueriesMixin:
    """Config queries of ``DeepSpeedEngine``; the engine provides ``config``."""

    config: "ShardwiseConfig"

    # --- precision --------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def fp16_auto_cast(self) -> bool:
        return bool(self.config.fp16.auto_cast)

    def fp16_master_weights_and_gradients(self) -> bool:
        return bool(self.config.fp16.fp16_master_weights_and_grads)

    def bf16_master_weights_and_gradients(self) -> bool:
        return False  # master weights and gradients are always fp32

    def bf16_optimizer_states(self) -> bool:
        return False  # optimizer states are always fp32

    def amp_enabled(self) -> bool:
        return False  # NVIDIA Apex is never used

    def loss_scale(self) -> float:
        return float(self.config.fp16.loss_scale)

    def dynamic_loss_scale(self) -> bool:
        return float(self.config.fp16.loss_scale) == 0.0

    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.config.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> Dict[str, Any]:
        fp16 = self.config.fp16
        return {"init_scale": 2 ** fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def torch_autocast_enabled(self) -> bool:
        return bool(self.config.torch_autocast.enabled)

    def torch_autocast_dtype(self) -> torch.dtype:
        return self.config.torch_autocast.dtype

    def torch_autocast_lower_precision_safe_modules(self) -> List[str]:
        names = self.config.torch_autocast.lower_precision_safe_modules
        return list(_AUTOCAST_SAFE_MODULES if names is None else names)

    def get_data_types(self) -> Tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype); shardwise accumulates in fp32 unless
        data_types.grad_accum_dtype says otherwise."""
        accum = torch_dtype_of(self.config.data_types.grad_accum_dtype) or torch.float32
        return self.config.compute_dtype, accum

    # --- engine behaviour keys -----------------------------------------------------------------
    def steps_per_print(self) -> int:
        return int(self.config.steps_per_print)

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown)

    def memory_breakdown(self) -> bool:
        return bool(self.config.memory_breakdown)

    def dump_state(self) -> bool:
        return bool(self.config.dump_state)

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return float(self.config.gradient_predivide_factor)

    def sparse_gradients_enabled(self) -> bool:
        return False  # gradients are always reduced densely

    def managed_gradient_accumulation(self) -> bool:
        return True  # the engine owns the boundary (set_gradient_accumulation_boundary overrides)

    def dataloader_drop_last(self) -> bool:
        return bool(self.config.dataloader_drop_last)

    def graph_harvesting(self) -> bool:
        return False

    # --- optimizer and scheduler sections ------------------------------------------------------
    def optimizer_name(self) -> Optional[str]:
        """The client optimizer's class name, else the config's optimizer type (DeepSpeed's rule)."""
        if self.config.optimizer is not None:
            return self.config.optimizer.type
        inner = getattr(getattr(self, "optimizer", None), "inner", None)
        return type(inner).__name__ if inner is not None else None

    def optimizer_params(self) -> Optional[Dict[str, Any]]:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def optimizer_legacy_fusion(self) -> bool:
        return bool(self.config.optimizer.legacy_fusion) if self.config.optimizer else False

    def scheduler_name(self) -> Optional[str]:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> Optional[Dict[str, Any]]:
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    # --- ZeRO ----------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero_optimization.stage >= 3

    def is_first_weights_partition_group(self) -> bool:
        return self.zero_optimization_partition_weights()  # no MiCS groups: one partition group

    def zero_allow_untested_optimizer(self) -> bool:
        return bool(self.config.zero_allow_untested_optimizer)

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return False  # torch's CPU optimizer steps offloaded states

    def zero_offload_optimizer(self) -> Any:
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Any:
        return self.config.zero_optimization.offload_param

    def zero_use_cpu_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer_device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer_device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer_device == "nvme"

    def zero_partial_offload(self) -> float:
        opt = self.config.zero_optimization.offload_optimizer
        return float(opt.ratio) if opt is not None else 1.0

    def super_offload(self) -> bool:
        return False

    def zero_grad_hooks(self) -> bool:
        return True  # gradients always reach the strategy through hooks

    def zero_log_trace_cache_warnings(self) -> bool:
        return False

    def zero_allgather_sequential(self) -> bool:
        return False

    def is_sanity_checks_enabled(self) -> bool:
        return False

    def compile_zero_optimization_stage(self) -> bool:
        return False  # no DeepCompile passes

    def compile_autosp(self) -> bool:
        return False

    def compile_autotp(self) -> bool:
        return False

    def uses_parallelization_pass_only(self) -> bool:
        return False

    def is_deepcompile_enabled(self) -> bool:
        """``compile.deepcompile`` is set (DeepSpeed's query)."""
        return bool(self.config.compile.deepcompile)

    def is_deepcompile_active(self) -> bool:
        """``compile.deepcompile`` is set and the model is compiled."""
        return self.is_deepcompile_enabled() and bool(getattr(self, "is_compiled", False))

    def _zero(self, key: str) -> Any:
        return getattr(self.config.zero_optimization, key)

    def zero_reduce_scatter(self) -> bool:
        return bool(self._zero("reduce_scatter"))

    def zero_overlap_comm(self) -> bool:
        return bool(self._zero("overlap_comm"))

    def zero_contiguous_gradients(self) -> bool:
        return bool(self._zero("contiguous_gradients"))

    def zero_reduce_bucket_size(self) -> int:
        return int(self._zero("reduce_bucket_size"))

    def zero_allgather_bucket_size(self) -> int:
        return int(self._zero("allgather_bucket_size"))

    def zero_allgather_partitions(self) -> bool:
        return bool(self._zero("allgather_partitions"))

    def zero_round_robin_gradients(self) -> bool:
        return bool(self._zero("round_robin_gradients"))

    def zero_sub_group_size(self) -> int:
        return int(self._zero("sub_group_size"))

    def zero_prefetch_bucket_size(self) -> int:
        return int(self._zero("prefetch_bucket_size"))

    def zero_max_live_parameters(self) -> int:
        return int(self._zero("max_live_parameters"))

    def zero_max_reuse_distance(self) -> int:
        return int(self._zero("max_reuse_distance"))

    def zero_param_persistence_threshold(self) -> int:
        return int(self._zero("param_persistence_threshold"))

    def zero_model_persistence_threshold(self) -> int:
        return int(self._zero("model_persistence_threshold"))

    def zero_module_granularity_threshold(self) -> int:
        return int(self._zero("module_granularity_threshold"))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._zero("gather_16bit_weights_on_model_save"))

    def zero_ignore_unused_parameters(self) -> bool:
        return bool(self._zero("ignore_unused_parameters"))

    def zero_load_from_fp32_weights(self) -> bool:
        return bool(self._zero("load_from_fp32_weights"))

    def zero_elastic_checkpoint(self) -> bool:
        return bool(self._zero("elastic_checkpoint"))

    def zero_legacy_stage1(self) -> bool:
        return bool(self._zero("legacy_stage1"))

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return bool(self._zero("use_multi_rank_bucket_allreduce"))

    def mics_shard_size(self) -> int:
        return int(self._zero("mics_shard_size"))

    def zero_hpz_partition_size(self) -> int:
        return int(self._zero("zero_hpz_partition_size"))

    def zero_quantized_weights(self) -> bool:
        return bool(self._zero("zero_quantized_weights"))

    def zero_quantized_nontrainable_weights(self) -> bool:
        return bool(self._zero("zero_quantized_nontrainable_weights"))

    def zero_quantized_gradients(self) -> bool:
        return bool(self._zero("zero_quantized_gradients"))


    # --- checkpoint and IO sections ------------------------------------------------------------
    def checkpoint_tag_validation_enabled(self) -> bool:
        return self.config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self.config.checkpoint.tag_validation == "Fail"

    def checkpoint_writer_enabled(self) -> bool:
        return False  # no pluggable checkpoint writer

    def use_node_local_storage(self) -> bool:
        return bool(self.config.checkpoint.use_node_local_storage)

    def load_universal_checkpoint(self) -> bool:
        return bool(self.config.checkpoint.load_universal)

    def aio_config(self) -> Dict[str, Any]:
        return self.config.aio.model_dump()

    def swap_tensor_config(self) -> Optional[Dict[str, Any]]:
        """The optimizer's NVMe swap settings (the ``offload_optimizer`` section: nvme_path,
        buffer_count, ...) when it offloads to NVMe, else None."""
        oo = self.config.zero_optimization.offload_optimizer
        return oo.model_dump() if oo is not None and oo.device == "nvme" else None

    # --- features shardwise does not have: their switches read "off" -----------------------------
    def elasticity_enabled(self) -> bool:
        return False

    def is_elastic_model_parallel_supported(self) -> bool:
        return False

    def pld_enabled(self) -> bool:
        return False

    def get_pld_theta(self) -> None:
        return None  # DeepSpeed's value when progressive layer drop is off

    def eigenvalue_enabled(self) -> bool:
        return False

    def curriculum_enabled_legacy(self) -> bool:
        return False

    def data_efficiency_enabled(self) -> bool:
        return False

    def data_sampling_enabled(self) -> bool:
        return False

    def curriculum_learning_enabled(self) -> bool:
        return False

    def random_ltd_enabled(self) -> bool:
        return False

    def flops_profiler_enabled(self) -> bool:
        return bool(self.config.flops_profiler.enabled)

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self.config.flops_profiler.recompute_fwd_factor

    def flops_profiler_profile_step(self) -> int:
        return self.config.flops_profiler.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self.config.flops_profiler.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self.config.flops_profiler.top_modules

    def flops_profiler_detailed(self) -> bool:
        return bool(self.config.flops_profiler.detailed)

    def flops_profiler_output_file(self) -> Optional[str]:
        return self.config.flops_profiler.output_file

    def autotuning_enabled(self) -> bool:
        return bool(self.config.autotuning.enabled)

    def autotuning_profile_model_info(self) -> bool:
        info = self.config.autotuning.model_info
        return bool(self.autotuning_enabled() and isinstance(info, dict) and info.get("profile"))

    def autotuning_start_profile_step(self) -> int:
        return self.config.autotuning.start_profile_step

    def autotuning_end_profile_step(self) -> int:
        return self.config.autotuning.end_profile_step

    def autotuning_metric_path(self) -> Optional[str]:
        return self.config.autotuning.metric_path

    def autotuning_model_info_path(self) -> Optional[str]:
        return self.config.autotuning.model_info_path

    def autotuning_metric(self) -> str:
        return self.config.autotuning.metric

    # --- parallel layout: data parallel only ---------------------------------------------------
    def get_tensor_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_rank(self) -> int:
        return 0

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

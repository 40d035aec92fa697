"""Section models: defaults, aliases, coercions, derived properties, ignored sections."""
from __future__ import annotations

import sys

import pytest
import torch

from shardwise.config import IGNORED_SECTIONS, ShardwiseConfig, load_config
from shardwise.config.zero import ZeroConfig


def test_top_level_defaults():
    cfg = load_config({})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (1, 1, 1)
    assert cfg.steps_per_print == 10 and cfg.gradient_clipping == 0.0
    assert cfg.zero_allow_untested_optimizer is True and cfg.strict_config is False
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.compute_dtype == torch.float32 and cfg.communication_dtype is None
    assert cfg.empty_cache_after_step is False
    assert cfg.checkpoint.tag_validation == "Warn" and cfg.aio.block_size == 1048576
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.loss_scale == 0
    assert cfg.torch_autocast.dtype == torch.bfloat16
    assert cfg.activation_checkpointing.policy == "full" and cfg.activation_checkpointing.modules == []


def test_zero_defaults_match_deepspeed():
    zero = load_config({}).zero_optimization
    assert zero.stage == 0 and zero.contiguous_gradients and zero.reduce_scatter
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    assert zero.prefetch_bucket_size == 50_000_000 and zero.param_persistence_threshold == 100_000
    assert zero.model_persistence_threshold == sys.maxsize
    assert zero.max_live_parameters == zero.max_reuse_distance == zero.sub_group_size == 1_000_000_000
    assert zero.offload_optimizer_device == "none" and zero.offload_param_device == "none"


@pytest.mark.parametrize("stage, expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_dynamic_default(stage, expected):
    assert load_config({"zero_optimization": {"stage": stage}}).zero_optimization.overlap_comm is expected
    assert load_config({"zero_optimization": {"stage": stage, "overlap_comm": not expected}}
                       ).zero_optimization.overlap_comm is (not expected)


@pytest.mark.parametrize("prefixed", [True, False])
def test_stage3_keys_accept_both_spellings_and_float_ints(prefixed):
    names = ["prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
             "max_live_parameters", "max_reuse_distance", "module_granularity_threshold"]
    raw = {("stage3_" + n if prefixed else n): 1e5 + i for i, n in enumerate(names)}
    raw["stage3_gather_16bit_weights_on_model_save" if prefixed else "gather_16bit_weights_on_model_save"] = True
    raw.update(stage=3, reduce_bucket_size=5e8)
    zero = load_config({"zero_optimization": raw}).zero_optimization
    for i, name in enumerate(names):
        value = getattr(zero, name)
        assert value == 100_000 + i and type(value) is int
    assert zero.gather_16bit_weights_on_model_save is True
    assert type(zero.reduce_bucket_size) is int
    assert "stage3_prefetch_bucket_size" not in load_config({"zero_optimization": raw}).to_dict()["zero_optimization"]


def test_legacy_fp16_gather_name_and_deprecated_offload_flags():
    cfg = load_config({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                                             "cpu_offload": True, "cpu_offload_param": True,
                                             "cpu_offload_use_pin_memory": True}})
    zero = cfg.zero_optimization
    assert zero.gather_16bit_weights_on_model_save is True
    assert zero.offload_optimizer_device == "cpu" and zero.offload_optimizer.pin_memory is True
    assert zero.offload_param_device == "cpu"
    assert any("cpu_offload is deprecated" in w for w in cfg.warnings)
    assert load_config({"zero_optimization": True}).zero_optimization.stage == 1


def test_offload_sections():
    zero = load_config({"zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "CPU", "pin_memory": True, "ratio": 0.25,
                              "delayed_update": True, "delayed_update_warmup": 3},
        "offload_param": {"device": "nvme", "nvme_path": "/tmp/x", "max_in_cpu": 1e9}}}).zero_optimization
    assert zero.offload_optimizer_device == "cpu" and zero.offload_optimizer.ratio == 0.25
    assert zero.offload_optimizer.delayed_update and zero.offload_optimizer.delayed_update_warmup == 3
    assert zero.offload_optimizer.buffer_count == 4
    assert zero.offload_param_device == "nvme" and zero.offload_param.buffer_count == 5


def test_precision_sections_and_compute_dtype():
    assert load_config({"fp16": {"enabled": True}}).compute_dtype == torch.float16
    cfg = load_config({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled and cfg.compute_dtype == torch.bfloat16
    assert load_config({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}).bf16.enabled
    cfg = load_config({"torch_autocast": {"enabled": True, "dtype": "torch.float16",
                                          "lower_precision_safe_modules": ["torch.nn.Linear"]}})
    assert cfg.torch_autocast.dtype == torch.float16 and cfg.compute_dtype == torch.float32


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("float16", torch.float16),
                                         ("half", torch.float16), ("bf16", torch.bfloat16),
                                         ("torch.bfloat16", torch.bfloat16), ("FP32", torch.float32)])
def test_communication_dtype_spellings(name, dtype):
    cfg = load_config({"communication_data_type": name, "data_types": {"grad_accum_dtype": name}})
    assert cfg.communication_dtype == dtype
    assert cfg.data_types.grad_accum_dtype in ("fp32", "fp16", "bf16")


def test_checkpoint_activation_and_aio_sections():
    cfg = load_config({"checkpoint": {"tag_validation": "IGNORE", "use_node_local_storage": True,
                                      "parallel_write": {"pipeline_stage": True}},
                       "activation_checkpointing": {"partition_activations": True, "number_checkpoints": False,
                                                    "policy": "Selective", "modules": ["Block"]},
                       "aio": {"thread_count": 4, "single_submit": False}})
    assert cfg.checkpoint.tag_validation == "Ignore" and cfg.checkpoint.parallel_write == {"pipeline_stage": True}
    ac = cfg.activation_checkpointing
    assert ac.policy == "selective" and ac.number_checkpoints is None and ac.modules == ["Block"]
    assert cfg.aio.thread_count == 4


def test_optimizer_and_scheduler_keep_type_and_params():
    cfg = load_config({"optimizer": {"type": "SomeFutureOptimizer", "params": {"lr": 0.1, "foo": [1, 2]}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}})
    assert cfg.optimizer.type == "SomeFutureOptimizer" and cfg.optimizer.params == {"lr": 0.1, "foo": [1, 2]}
    assert cfg.scheduler.type == "WarmupLR" and cfg.scheduler.params == {"warmup_num_steps": 5}


def test_ignored_sections_are_fields_kept_verbatim_and_warn_once_each():
    assert set(IGNORED_SECTIONS) <= set(ShardwiseConfig.model_fields)
    raw = {"autotuning": {"enabled": True, "results_dir": "runs"}, "elasticity": {"enabled": True},
           "zero_force_ds_cpu_optimizer": True, "amp": {"enabled": False},
           "flops_profiler": {"enabled": True}, "comms_logger": {"enabled": True}}
    cfg = load_config(raw)
    assert cfg.autotuning == {"enabled": True, "results_dir": "runs"}
    warned = [name for name in IGNORED_SECTIONS if any(f"'{name}'" in w for w in cfg.warnings)]
    assert warned == ["autotuning", "elasticity", "zero_force_ds_cpu_optimizer"]  # off ones stay quiet
    # flops_profiler and comms_logger are real sections now (shardwise.profiling, shardwise.comm)
    assert cfg.flops_profiler.enabled and cfg.comms_logger.enabled
    assert not any("flops_profiler" in w or "comms_logger" in w for w in cfg.warnings)


def test_inert_zero_key_set_to_non_default_warns():
    cfg = load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                             "use_multi_rank_bucket_allreduce": True}})
    assert any("zero_optimization.zero_quantized_weights" in w for w in cfg.warnings)
    assert not any("use_multi_rank_bucket_allreduce" in w for w in cfg.warnings)  # default value: quiet


def test_every_field_has_a_docstring():
    from shardwise.config.base import ConfigModel
    from shardwise.config.keys import nested_model

    def walk(model):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no docstring"
            child = nested_model(info.annotation)
            if child is not None:
                walk(child)
    walk(ShardwiseConfig)
    assert issubclass(ZeroConfig, ConfigModel)

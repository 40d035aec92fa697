"""Misspelt config keys are an error naming both spellings; DeepSpeed keys shardwise does not
use, the seed's keys and keys that match nothing still load; numeric strings load as
DeepSpeed's pydantic models load them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.config import ShardwiseConfig, load_config
from shardwise.config.keys import WalkReport, edit_distance, normalize
from shardwise.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("raw, typo, known", [
    ({"zero_optimisation": {"stage": 2}}, "zero_optimisation", "zero_optimization"),
    ({"zero_optimization": {"stag": 2}}, "zero_optimization.stag", "zero_optimization.stage"),
    ({"fp16": {"enabeld": True}}, "fp16.enabeld", "fp16.enabled"),  # a swap is one edit
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameter": 10}},
     "zero_optimization.stage3_max_live_parameter", "zero_optimization.stage3_max_live_parameters"),
    ({"zero_optimization": {"offload_optimizer": {"devce": "cpu"}}},
     "zero_optimization.offload_optimizer.devce", "zero_optimization.offload_optimizer.device"),
    ({"gradient_acumulation_step": 4}, "gradient_acumulation_step", "gradient_accumulation_steps"),
    ({"train_micro_batch_size_per_GPU": 4}, "train_micro_batch_size_per_GPU",
     "train_micro_batch_size_per_gpu"),
])
def test_a_misspelt_key_is_an_error_naming_both(raw, typo, known):
    with pytest.raises(ConfigError, match=rf"'{typo}' is not a config key; it is \d edits? from "
                                          rf"'{known}'"):
        load_config(raw)


def test_every_misspelling_is_listed_at_once_and_not_silenced_by_strict_false():
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": {"stag": 2, "overlap_com": True}, "fp16": {"enabeld": 1}},
                    strict=False)
    text = str(info.value)
    for key in ("zero_optimization.stag", "zero_optimization.overlap_com", "fp16.enabeld"):
        assert f"'{key}'" in text
    assert "SHARDWISE_ALLOW_CONFIG_TYPOS=1" in text


def test_the_environment_can_turn_typos_into_warnings(monkeypatch):
    monkeypatch.setenv("SHARDWISE_ALLOW_CONFIG_TYPOS", "1")
    cfg = load_config({"zero_optimization": {"stag": 2}})
    assert cfg.zero_optimization.stage == 0  # the misspelt key is still not used
    assert any("'zero_optimization.stag'" in w and "'zero_optimization.stage'" in w
               for w in cfg.warnings)


def test_keys_that_match_nothing_only_warn():
    cfg = load_config({"my_project_notes": "x", "zero_optimization": {"stage": 1, "custom_knob": 3}})
    assert cfg.zero_optimization.stage == 1
    assert any("Unknown config key 'my_project_notes' (ignored)" in w for w in cfg.warnings)
    assert any("'zero_optimization.custom_knob'" in w for w in cfg.warnings)


def test_short_keys_need_a_closer_match():
    assert edit_distance("stag", "stage") == 1 and edit_distance("enabeld", "enabled") == 1
    cfg = load_config({"tp": 2, "zero_optimization": {"stage": 1, "sta": 1}})  # 2 edits, short keys
    assert sum("Unknown config key" in w for w in cfg.warnings) == 2


#: DeepSpeed keys (DeepSpeed's pydantic models and runtime/config.py, 2026) per section: none is
#: ever a typo, whether shardwise uses it, ignores it, or drops it with a note.
DEEPSPEED_TOP = (
    "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps steps_per_print "
    "dump_state optimizer scheduler fp16 bf16 bfloat16 amp torch_autocast gradient_clipping "
    "prescale_gradients gradient_predivide_factor communication_data_type "
    "seq_parallel_communication_data_type sparse_gradients zero_optimization "
    "zero_allow_untested_optimizer zero_force_ds_cpu_optimizer wall_clock_breakdown "
    "memory_breakdown dataloader_drop_last disable_allgather graph_harvesting log_level "
    "managed_gradient_accumulation gradient_allreduce_op use_data_before_expert_parallelism "
    "activation_checkpointing sparse_attention flops_profiler comms_logger tensorboard wandb "
    "csv_monitor comet elasticity autotuning pipeline progressive_layer_drop eigenvalue "
    "curriculum_learning data_efficiency compression_training checkpoint data_types aio nebula "
    "hybrid_engine compile tensor_parallel timers weight_quantization quantize_training "
    "sequence_parallel_size expert_parallel vocabulary_size").split()
DEEPSPEED_ZERO = (
    "stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce "
    "allgather_partitions allgather_bucket_size overlap_comm load_from_fp32_weights "
    "elastic_checkpoint zenflow sub_group_size prefetch_bucket_size stage3_prefetch_bucket_size "
    "param_persistence_threshold stage3_param_persistence_threshold model_persistence_threshold "
    "stage3_model_persistence_threshold max_live_parameters stage3_max_live_parameters "
    "max_reuse_distance stage3_max_reuse_distance gather_16bit_weights_on_model_save "
    "stage3_gather_16bit_weights_on_model_save module_granularity_threshold "
    "stage3_module_granularity_threshold use_all_reduce_for_fetch_params "
    "stage3_use_all_reduce_for_fetch_params allgather_sequential stage3_allgather_sequential "
    "stage3_gather_fp16_weights_on_model_save ignore_unused_parameters legacy_stage1 "
    "round_robin_gradients zero_hpz_partition_size zero_quantized_weights "
    "zero_quantized_nontrainable_weights zero_quantized_gradients zeropp_loco_param mics_shard_size "
    "mics_hierarchical_params_gather memory_efficient_linear pipeline_loading_checkpoint "
    "override_module_apply log_trace_cache_warnings enable_sanity_checks "
    "save_muon_momentum_buffer_in_memory leaf_module").split()
DEEPSPEED_SECTIONS = {
    "fp16": "enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis "
            "consecutive_hysteresis min_loss_scale fp16_master_weights_and_grads",
    "bf16": "enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads "
            "bf16_optimizer_states",
    "torch_autocast": "enabled dtype lower_precision_safe_modules",
    "activation_checkpointing": "partition_activations contiguous_memory_optimization "
                                "cpu_checkpointing number_checkpoints "
                                "synchronize_checkpoint_boundary profile",
    "checkpoint": "tag_validation load_universal use_node_local_storage parallel_write",
    "data_types": "grad_accum_dtype param_dtype",
    "aio": "block_size queue_depth intra_op_parallelism single_submit overlap_events thread_count "
           "use_gds",
    "compile": "enabled backend kwargs deepcompile free_activation free_activation_threshold "
               "offload_activation offload_activation_pin_memory offload_opt_states double_buffer "
               "symmetric_memory debug_log offload_parameters sync_before_reduce sync_after_reduce "
               "sync_before_allgather sync_after_allgather keep_int_input_tensors "
               "keep_all_input_tensors passes",
}
DEEPSPEED_OFFLOAD = {
    "offload_optimizer": "device nvme_path buffer_count pin_memory pipeline_read pipeline_write "
                         "fast_init ratio super_offload cpuadam_cores_perc",
    "offload_param": "device nvme_path buffer_count buffer_size max_in_cpu pin_memory",
}


def _no_typo_or_unknown(raw):
    cfg = load_config(raw)  # a typo would raise
    assert not [w for w in cfg.warnings if w.startswith("Unknown config key")], cfg.warnings


def _names_known(raw):
    """The key walk alone (key names, not values): no typo, no unknown key."""
    report = WalkReport()
    normalize(raw, ShardwiseConfig, report)
    assert report.typos == [] and report.unknown == [], (report.typos, report.unknown)


def test_deepspeed_keys_are_never_typos():
    _names_known({k: None for k in DEEPSPEED_TOP})
    _names_known({"zero_optimization": {k: None for k in DEEPSPEED_ZERO}})
    for section, keys in DEEPSPEED_SECTIONS.items():
        _names_known({section: {k: None for k in keys.split()}})
    for section, keys in DEEPSPEED_OFFLOAD.items():
        _names_known({"zero_optimization": {section: {k: None for k in keys.split()}}})


def test_deepspeed_keys_without_a_field_load_with_a_note():
    cfg = load_config({"managed_gradient_accumulation": True, "bf16": {"enabled": True,
                       "immediate_grad_update": True},
                       "zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}})
    assert cfg.bf16.enabled and cfg.zero_optimization.stage == 2
    for key in ("managed_gradient_accumulation", "bf16.immediate_grad_update",
                "zero_optimization.zenflow"):
        assert any(f"'{key}' is a DeepSpeed key with no effect" in w for w in cfg.warnings), key


def test_example_and_seed_configs_still_load():
    from tests.unit.test_config_seed import SEED_3_1, SEED_3_3, SEED_4_1, SEED_4_2
    cfg = load_config(str(ROOT / "examples" / "ds_config.json"))
    assert cfg.zero_optimization.stage == 2 and cfg.train_micro_batch_size_per_gpu == 4
    for raw in (SEED_3_1, json.loads(SEED_3_3), SEED_4_1, SEED_4_2):
        _no_typo_or_unknown(raw)


@pytest.mark.parametrize("value", ["2", " 2 ", "2.0", 2.0, 2])
def test_numeric_strings_load_as_deepspeeds_pydantic_loads_them(value):
    assert load_config({"zero_optimization": {"stage": value}}).zero_optimization.stage == 2


def test_numeric_strings_everywhere_pydantic_accepts_them():
    cfg = load_config({"train_micro_batch_size_per_gpu": "4", "gradient_accumulation_steps": "2",
                       "gradient_clipping": "1.0", "steps_per_print": "5",
                       "fp16": {"enabled": "true", "initial_scale_power": "12"},
                       "zero_optimization": {"stage": "3", "reduce_bucket_size": "1000",
                                             "overlap_comm": "false",
                                             "offload_optimizer": {"device": "cpu", "ratio": "0.5"}}},
                      world_size=2)
    zero = cfg.zero_optimization
    assert (cfg.train_batch_size, cfg.gradient_clipping, cfg.steps_per_print) == (16, 1.0, 5)
    assert cfg.fp16.enabled is True and cfg.fp16.initial_scale_power == 12
    assert (zero.stage, zero.reduce_bucket_size, zero.overlap_comm) == (3, 1000, False)
    assert zero.offload_optimizer.ratio == 0.5
    for bad in ("two", "2.5", "4"):
        with pytest.raises(ConfigError, match="is not a ZeRO stage"):
            load_config({"zero_optimization": {"stage": bad}})

"""init_inference's config: DeepSpeed's keys, defaults, aliases, merge rule and errors."""
import json

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.inference.config import InferenceConfig, load_inference_config
from shardwise.inference.zero_inference import settings_from

#: The seed article's section 4.2 config, verbatim (Python literal in the article).
SEED_4_2 = {"tensor_parallel": {"tp_size": 1, "windows_tp_optimization": True},
            "inference": {"kernel_inject": True, "replace_with_kernel_inject": True,
                          "windows_kernel_optimization": True},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                  "stage3_param_persistence_threshold": 1e5,
                                  "stage3_max_live_parameters": 1e7}}


def test_deepspeed_defaults():
    cfg = load_inference_config()
    assert cfg.dtype == "fp16" and not cfg.dtype_given
    assert cfg.replace_with_kernel_inject is False
    assert cfg.tensor_parallel.tp_size == 1 and cfg.tensor_parallel.tp_grain_size == 64
    assert cfg.max_out_tokens == 1024 and cfg.min_out_tokens == 1
    assert cfg.triangular_masking is True and cfg.return_tuple is True
    assert cfg.checkpoint is None and cfg.base_dir == ""


def test_aliases_and_dtype_spellings():
    cfg = load_inference_config({"kernel_inject": True, "tp": {"tp_size": 2}, "max_tokens": 64,
                                 "min_tokens": 4, "dtype": torch.bfloat16})
    assert cfg.replace_with_kernel_inject and cfg.tp_size == 2
    assert (cfg.max_out_tokens, cfg.min_out_tokens, cfg.dtype) == (64, 4, "bf16")
    assert load_inference_config(dtype="int8").int8
    assert load_inference_config(dtype=torch.int8).int8
    assert load_inference_config(dtype="half").dtype == "fp16"


def test_mp_size_is_the_old_tp_size():
    assert load_inference_config(mp_size=2).tp_size == 2
    with pytest.raises(ConfigError, match="mp_size"):
        load_inference_config(mp_size=2, tensor_parallel={"tp_size": 4})


def test_json_path_and_kwargs_merge(tmp_path):
    path = tmp_path / "ds_inference.json"
    path.write_text(json.dumps({"dtype": "bf16", "max_out_tokens": 256}))
    cfg = load_inference_config(str(path), replace_with_kernel_inject=True)
    assert cfg.dtype == "bf16" and cfg.max_out_tokens == 256 and cfg.replace_with_kernel_inject
    assert load_inference_config({"dtype": "bf16"}, dtype="bf16").dtype == "bf16"  # same value: fine


def test_conflicting_key_names_it():
    with pytest.raises(ConfigError, match="Conflicting argument 'dtype'.*fp16.*bf16"):
        load_inference_config({"dtype": "fp16"}, dtype="bf16")


def test_bad_keys_and_values_are_named():
    with pytest.raises(ConfigError, match="tensor_paralel.*Did you mean 'tensor_parallel'"):
        load_inference_config({"tensor_paralel": {"tp_size": 2}})
    with pytest.raises(ConfigError, match="dtype.*'int4'.*int8"):
        load_inference_config(dtype="int4")
    with pytest.raises(ConfigError, match="max_out_tokens"):
        load_inference_config(max_out_tokens=0)
    with pytest.raises(ConfigError, match="tensor_parallel.tp_size"):
        load_inference_config(tensor_parallel={"tp_size": 0})
    with pytest.raises(ConfigError, match="min_out_tokens = 64 is larger than max_out_tokens = 32"):
        load_inference_config(max_out_tokens=32, min_out_tokens=64)
    with pytest.raises(ConfigError, match="no such JSON file"):
        load_inference_config("/nonexistent/ds.json")


def test_inert_key_warns(caplog):
    cfg = load_inference_config(use_triton=False, triangular_masking=False,
                                injection_policy={"LlamaDecoderLayer": ("self_attn.o_proj",)})
    assert any("triangular_masking" in w and "no effect" in w for w in cfg.warnings)
    assert any("injection_policy" in w and "not applied" in w for w in cfg.warnings)


def test_quant_section_says_what_applies():
    """DeepSpeed's MoQ settings do nothing here and say so; quant.lm_head (ours) acts with int8."""
    cfg = load_inference_config(dtype="int8", quant={"weight": {"num_bits": 4}, "activation": {"num_bits": 8}})
    assert any("quant.weight" in w and "8 bits" in w and "weight_quantization" in w for w in cfg.warnings)
    assert any("quant.activation" in w and "weight-only" in w for w in cfg.warnings)
    assert cfg.quant.lm_head is True  # the default: an untied head is quantized too
    off = load_inference_config(dtype="int8", quant={"lm_head": False})
    assert off.quant.lm_head is False and off.warnings == []
    bf16 = load_inference_config(dtype="bf16", quant={"lm_head": False})
    assert any("quant.lm_head" in w and "bf16" in w for w in bf16.warnings)


def test_seed_section_4_2_loads_and_routes_zero_inference():
    cfg = load_inference_config(SEED_4_2)
    assert isinstance(cfg, InferenceConfig)
    assert cfg.replace_with_kernel_inject  # from the nested "inference" section
    assert cfg.zero.stage == 3 and cfg.wants_param_offload
    assert cfg.zero.param_persistence_threshold == 100000
    text = " ".join(cfg.warnings)
    for named in ("windows_kernel_optimization", "windows_tp_optimization", "zero_optimization",
                  "'inference'"):
        assert named in text
    assert settings_from(cfg).persistence_threshold == 100000
    assert settings_from(cfg).max_live_parameters == 10_000_000


#: DeepSpeedInferenceConfig's fields with their defaults (deepspeed/inference/config.py).
DEEPSPEED_DEFAULTS = {
    "replace_with_kernel_inject": False, "dtype": "fp16", "tensor_parallel": {}, "enable_cuda_graph": False,
    "use_triton": False, "triton_autotune": False, "zero": {}, "triangular_masking": True, "moe": {},
    "keep_module_on_host": False, "quant": {}, "checkpoint": None, "base_dir": "",
    "set_empty_params": False, "save_mp_checkpoint_path": None, "checkpoint_config": {},
    "return_tuple": True, "training_mp_size": 1, "replace_method": "auto", "injection_policy": None,
    "injection_policy_tuple": None, "config": None, "max_out_tokens": 1024, "min_out_tokens": 1,
    "transposed_mode": False, "mp_size": 1, "mpu": None, "ep_size": 1, "ep_group": None,
    "ep_mp_group": None, "moe_experts": [1], "moe_type": "standard",
}
DEEPSPEED_ALIASES = {"kernel_inject": True, "tp": {"tp_size": 1}, "tm": True, "ckpt_config": {},
                     "injection_dict": None, "args": None, "max_tokens": 1024, "min_tokens": 1,
                     "expert_group": None, "expert_mp_group": None}


def test_every_deepspeed_key_and_alias_loads():
    cfg = load_inference_config(DEEPSPEED_DEFAULTS)
    assert cfg.max_out_tokens == 1024 and cfg.tp_size == 1 and cfg.moe.ep_size == 1
    assert load_inference_config(DEEPSPEED_ALIASES).replace_with_kernel_inject
    sub = {"tensor_parallel": {"enabled": True, "tp_size": 1, "tp_grain_size": 64, "mpu": None,
                               "tp_group": None},
           "moe": {"enabled": True, "ep_size": 1, "num_experts": [1], "type": "standard",
                   "ep_mp_group": None, "expert_group": None},
           "quant": {"enabled": True, "activation": {}, "weight": {}, "qkv": {}},
           "checkpoint_config": {"checkpoint_dir": None, "save_mp_checkpoint_path": None,
                                 "base_dir": None}}
    assert load_inference_config(sub).tensor_parallel.tp_grain_size == 64
    assert load_inference_config(moe=False).moe.enabled is False

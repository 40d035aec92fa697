"""load_config: sources (dict, path, args, config_params, strings), JSON parsing, strict mode,
unknown-key warnings and the error messages for bad input."""
from __future__ import annotations

import argparse
import base64
import json
import logging
import uuid
from pathlib import Path

import pytest

from shardwise.config import ShardwiseConfig, load_config
from shardwise.errors import ConfigError


def _write(tmp_path: Path, text: str, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- sources ------------------------------------------------------------------------------
def test_dict_is_not_modified_and_values_land(tmp_path):
    raw = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    snapshot = json.dumps(raw, sort_keys=True)
    cfg = load_config(raw)
    assert json.dumps(raw, sort_keys=True) == snapshot  # the walk copies
    assert isinstance(cfg, ShardwiseConfig)
    assert cfg.zero_optimization.stage == 2
    assert cfg.train_micro_batch_size_per_gpu == 2


def test_path_str_and_pathlike_and_json_string(tmp_path):
    path = _write(tmp_path, json.dumps({"train_batch_size": 8, "steps_per_print": 3}))
    for source in (str(path), path, json.dumps({"train_batch_size": 8, "steps_per_print": 3})):
        cfg = load_config(source)
        assert (cfg.train_batch_size, cfg.steps_per_print) == (8, 3)


def test_base64_string_as_deepspeed_launcher_passes_it():
    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 6}).encode()).decode()
    assert load_config(encoded).train_batch_size == 6


def test_args_namespace_path_dict_and_shardwise_name(tmp_path):
    path = _write(tmp_path, '{"train_batch_size": 4}')
    assert load_config(args=argparse.Namespace(deepspeed_config=str(path))).train_batch_size == 4
    assert load_config(args=argparse.Namespace(deepspeed_config={"train_batch_size": 12})).train_batch_size == 12
    assert load_config(args=argparse.Namespace(shardwise_config=str(path))).train_batch_size == 4
    # args without a config attribute (or None) plus config= is fine
    assert load_config({"train_batch_size": 2}, args=argparse.Namespace(deepspeed_config=None)).train_batch_size == 2


def test_config_params_alias_and_conflicts():
    assert load_config(config_params={"train_batch_size": 10}).train_batch_size == 10
    with pytest.raises(ConfigError, match="config_params"):
        load_config({"train_batch_size": 1}, config_params={"train_batch_size": 1})
    with pytest.raises(ConfigError, match="Not sure how to proceed"):
        load_config({"train_batch_size": 1}, args=argparse.Namespace(deepspeed_config={"train_batch_size": 1}))
    with pytest.raises(ConfigError, match="No config was given.*deepspeed_config"):
        load_config()
    with pytest.raises(ConfigError, match="must be a dict"):
        load_config(42)


def test_to_dict_round_trips_through_load_config():
    cfg = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                       "bfloat16": {"enabled": True}, "torch_autocast": {"dtype": "float16"},
                       "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e7}}, world_size=2)
    dumped = cfg.to_dict()
    json.dumps(dumped)  # serialisable
    again = load_config(dumped, world_size=2)
    assert again.to_dict() == dumped
    assert again.gradient_accumulation_steps == 2 and dumped["torch_autocast"]["dtype"] == "fp16"


# --- JSON files ----------------------------------------------------------------------------
def test_comments_and_trailing_commas(tmp_path):
    text = """{
      // line comment with "quotes" and a comma,
      "train_batch_size": 8, /* block
         comment */ "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "note": "http://x//y /* z */",},},
      "aio": {"block_size": 1048576, "thread_count": 2,},  # hash comment
      "checkpoint": {"tag_validation": "fail"},
    }"""
    cfg = load_config(_write(tmp_path, text))
    assert cfg.train_batch_size == 8
    assert cfg.optimizer.params == {"lr": 1e-4, "note": "http://x//y /* z */"}
    assert cfg.checkpoint.tag_validation == "Fail"
    assert cfg.aio.thread_count == 2


def test_bad_json_names_file_line_and_column(tmp_path):
    bad_line = '  "fp16": {"enabled": tru}'
    path = _write(tmp_path, '{\n  "train_batch_size": 8, // comment before the error\n' + bad_line + '\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    column = bad_line.index("tru") + 1  # 1-based, where the bad token starts
    assert str(path.resolve()) in text and "line 3" in text and f"column {column}" in text
    assert bad_line in text  # the offending line is quoted


def test_duplicate_keys_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match="Duplicate key 'train_batch_size'"):
        load_config(_write(tmp_path, '{"train_batch_size": 8, "train_batch_size": 16}'))


def test_missing_file_names_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config("nope/ds_config.json")
    assert str((tmp_path / "nope" / "ds_config.json").resolve()) in str(info.value)
    assert "does not exist" in str(info.value)


# --- unknown keys and strict mode ------------------------------------------------------------
def test_unknown_keys_warn_with_dotted_path_and_suggestion():
    # keys a few edits from a key of their section are typos: an error (tests/unit/test_config_typos.py)
    cfg = load_config({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
                       "stage": 3, "optimiser_settings": {"lr": 1}})
    warnings = "\n".join(cfg.warnings)
    assert "'stage' (ignored). Did you mean 'zero_optimization.stage'?" in warnings  # wrong section
    assert "Unknown config key 'optimiser_settings' (ignored)." in warnings
    assert cfg.zero_optimization.stage == 1  # ignored, not guessed


def test_unknown_key_warning_reaches_the_shardwise_logger():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("shardwise")
    log.addHandler(handler)
    try:
        key = f"made_up_{uuid.uuid4().hex[:8]}"  # unique: warn_once deduplicates per process
        load_config({key: 1})
    finally:
        log.removeHandler(handler)
    messages = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any(f"Unknown config key '{key}'" in m for m in messages)


@pytest.mark.parametrize("how", ["arg", "config_key", "env"])
def test_strict_mode_makes_unknown_keys_errors(how, monkeypatch):
    raw = {"zero_optimization": {"stage": 1, "overlap_com": True}}
    kwargs = {}
    if how == "arg":
        kwargs["strict"] = True
    elif how == "config_key":
        raw["strict_config"] = True
    else:
        monkeypatch.setenv("SHARDWISE_STRICT_CONFIG", "1")
    with pytest.raises(ConfigError, match=r"zero_optimization\.overlap_com.*zero_optimization\.overlap_comm"):
        load_config(raw, **kwargs)


def test_strict_false_overrides_env(monkeypatch):
    monkeypatch.setenv("SHARDWISE_STRICT_CONFIG", "1")
    cfg = load_config({"typo_key": 1}, strict=False)
    assert any("typo_key" in w for w in cfg.warnings)


# --- wrong types and bad values -----------------------------------------------------------
def test_wrong_type_names_key_value_type_and_example():
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}})
    text = str(info.value)
    assert "zero_optimization.reduce_bucket_size = 'big' (str)" in text
    assert "expected an integer" in text and '"reduce_bucket_size": 500000000' in text


def test_several_wrong_types_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config({"fp16": {"enabled": "maybe", "loss_scale_window": 2.5}})
    text = str(info.value)
    assert "fp16.enabled = 'maybe'" in text and "true or false" in text
    assert "fp16.loss_scale_window = 2.5" in text


@pytest.mark.parametrize("raw, pattern", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    ({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
     r"max_grad_norm.*\"gradient_clipping\": 1.0"),
    ({"zero_optimization": {"stage": 5}}, r"zero_optimization.stage = 5 is not a ZeRO stage.*0.*3"),
    ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage = -1"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     r"offload_optimizer.device = 'gpu'.*'none', 'cpu' or 'nvme'"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "nvme_path is not set"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer.device = 'cpu' needs ZeRO stage 1, 2 or 3"),
    ({"optimizer": {"params": {"lr": 1}}}, r"optimizer.type = \(missing\).*\"AdamW\""),
    ({"gradient_clipping": -1.0}, "gradient_clipping = -1.0.*>= 0"),
    ({"communication_data_type": "int8"}, "communication_data_type: 'int8' is not a dtype"),
    ({"zero_optimization": {"stage3_max_live_parameters": 1e7, "max_live_parameters": 5}},
     "two spellings of the same key"),
    ({"zero_optimization": 3}, r"zero_optimization = 3 \(int\): expected an object"),
])
def test_bad_values_raise_config_error(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(raw)


def test_offload_param_below_stage3_warns_and_is_dropped_or_errors_in_strict():
    raw = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    cfg = load_config(raw)
    assert cfg.zero_optimization.offload_param is None
    assert cfg.zero_optimization.offload_param_device == "none"
    assert any("offload_param" in w and "needs ZeRO stage 3" in w and "stage = 2" in w for w in cfg.warnings)
    with pytest.raises(ConfigError, match="offload_param.*needs ZeRO stage 3.*stage = 2"):
        load_config(raw, strict=True)

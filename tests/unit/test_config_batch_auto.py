"""The batch triple for every combination of given keys and world sizes, and the "auto" rules."""
from __future__ import annotations

import itertools
import json

import pytest

from shardwise.config import load_config, resolve_batch
from shardwise.errors import ConfigError

KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
MICRO, GA = 3, 4  # the "true" values each case is built from


def _subsets():
    for n in range(len(KEYS) + 1):
        yield from itertools.combinations(KEYS, n)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("given", list(_subsets()), ids=lambda g: "+".join(k.split("_")[0] for k in g) or "none")
@pytest.mark.parametrize("as_auto", [False, True])
def test_batch_triple_every_combination(given, world_size, as_auto):
    truth = {"train_batch_size": MICRO * GA * world_size,
             "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA}
    raw = {k: truth[k] for k in given}
    if as_auto:  # "auto" on the missing keys behaves exactly like leaving them out
        raw.update({k: "auto" for k in KEYS if k not in given})
    cfg = load_config(raw, world_size=world_size)
    train, micro, ga = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    assert all(isinstance(v, int) for v in (train, micro, ga))
    assert train == micro * ga * world_size
    for key in given:  # given keys are kept
        assert getattr(cfg, key) == truth[key]
    # DeepSpeed's fill rules for what is missing
    if set(given) == {"train_batch_size"}:
        assert (micro, ga) == (truth["train_batch_size"] // world_size, 1)
    if "gradient_accumulation_steps" not in given and "train_batch_size" not in given:
        assert ga == 1
    if "train_micro_batch_size_per_gpu" not in given and "train_batch_size" not in given:
        assert micro == 1


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", [
    lambda w: (4 * w + 2, 4, None),   # train not divisible by micro * world
    lambda w: (4 * w + 1, 2, 2),      # all three given, product != train
    lambda w: (2 * w + 1, None, 2),   # train not divisible by ga * world
    lambda w: (3, 4, None),           # micro * world > train: GA would be 0
], ids=["train+micro", "all-three", "train+ga", "ga-zero"])
def test_batch_violation_message_has_all_four_numbers(world_size, case):
    train, micro, ga = case(world_size)
    raw = {k: v for k, v in zip(KEYS, (train, micro, ga)) if v is not None}
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=world_size)
    text = str(info.value)
    for key, value in zip(KEYS, (train, micro, ga)):
        assert f"{key}={value}" in text
    assert f"world_size={world_size}" in text


def test_batch_rejects_non_positive_and_bad_world_size():
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu must be a positive integer, got 0"):
        load_config({"train_micro_batch_size_per_gpu": 0})
    with pytest.raises(ConfigError, match="world_size must be a positive integer"):
        resolve_batch(8, None, None, 0)


# --- "auto" ---------------------------------------------------------------------------------
HF_STYLE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": "auto", "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": "auto",
                          "offload_optimizer": {"device": "cpu", "pin_memory": "auto"}},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    "communication_data_type": "auto", "activation_checkpointing": "auto",
    "wandb": {"enabled": "auto"},
}


def _contains_auto(value) -> bool:
    if isinstance(value, dict):
        return any(_contains_auto(v) for v in value.values())
    if isinstance(value, list):
        return any(_contains_auto(v) for v in value)
    return isinstance(value, str) and value.lower() == "auto"


def test_auto_everywhere_loads_with_defaults():
    cfg = load_config(HF_STYLE, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 1, 1)
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False
    assert cfg.gradient_clipping == 0.0
    assert cfg.zero_optimization.overlap_comm is True  # stage 3's default
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000  # default until resolve_auto
    assert cfg.optimizer.params == {} and cfg.scheduler.params == {}
    assert cfg.communication_data_type is None
    assert "zero_optimization.prefetch_bucket_size" in cfg.auto_fields  # canonical name recorded
    assert not _contains_auto(cfg.to_dict())


def test_resolve_auto_uses_hidden_size_and_lr():
    hidden = 768
    cfg = load_config(HF_STYLE).resolve_auto(hidden_size=hidden, optimizer_lr=3e-4)
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == hidden * hidden
    assert zero.prefetch_bucket_size == int(0.9 * hidden * hidden)
    assert zero.param_persistence_threshold == 10 * hidden
    assert cfg.optimizer.params == {"lr": 3e-4}
    assert cfg.scheduler.params == {"warmup_max_lr": 3e-4}
    dumped = cfg.to_dict()
    assert not _contains_auto(dumped)
    json.dumps(dumped)


def test_resolve_auto_leaves_explicit_values_alone():
    cfg = load_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
                       "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                             "stage3_prefetch_bucket_size": "auto"}})
    assert cfg.scheduler.params["warmup_max_lr"] == 1e-3  # the optimizer's explicit lr, at load
    cfg.resolve_auto(hidden_size=10, optimizer_lr=5.0)
    assert cfg.zero_optimization.reduce_bucket_size == 1000
    assert cfg.zero_optimization.prefetch_bucket_size == 90
    assert cfg.optimizer.params["lr"] == 1e-3


def test_resolve_auto_without_information_keeps_defaults_and_checks_input():
    cfg = load_config({"zero_optimization": {"reduce_bucket_size": "auto"},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
    cfg.resolve_auto()
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert "warmup_max_lr" not in cfg.scheduler.params
    cfg.resolve_auto(optimizer_lr=0.01)  # a client optimizer's lr fills the scheduler's peak
    assert cfg.scheduler.params["warmup_max_lr"] == 0.01
    with pytest.raises(ConfigError, match="hidden_size"):
        cfg.resolve_auto(hidden_size=0)


def test_auto_is_case_insensitive_and_works_in_lists():
    cfg = load_config({"optimizer": {"type": "Adam", "params": {"betas": ["auto", "auto"], "lr": 0.1}},
                       "fp16": {"enabled": "AUTO"}})
    assert cfg.optimizer.params == {"lr": 0.1} and cfg.fp16.enabled is False

"""The search space: what the user's ``"auto"`` values leave open, and one experiment's config.

Tunable keys (a fixed value is kept as it is; ``"auto"`` opens the choices below):

=============================================  ============================================
``zero_optimization.stage``                    "auto"/"all": 0-3; a list: those stages;
                                               missing: 0 (DeepSpeed's default)
``train_micro_batch_size_per_gpu``             "auto", missing or a list: searched
``gradient_accumulation_steps``                derived: holds ``train_batch_size`` when it is
                                               fixed, else the user's value (1 when "auto")
``zero_optimization.offload_optimizer``        "auto" or {"device": "auto"}: none, cpu (and
                                               nvme when the section names an nvme_path)
``zero_optimization.offload_param``            the same; stage 3 only, with optimizer offload
``activation_checkpointing.policy``            "auto": none, selective, full (needs "modules");
                                               a list: those policies
``compile.enabled`` (or ``"compile": "auto"``)  "auto": off, on
=============================================  ============================================
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from shardwise.config.keys import is_auto
from shardwise.errors import ConfigError

AC_SHORT = {"none": "", "selective": "_acsel", "full": "_acfull", "selective_ops": "_acselops",
            "offload": "_acoff"}


@dataclass(frozen=True)
class Choice:
    """Everything an experiment fixes except the batch geometry."""

    stage: int
    offload_optimizer: str = "none"
    """"none" | "cpu" | "nvme"."""
    offload_param: str = "none"
    """"none" | "cpu" | "nvme" (stage 3 only)."""
    ac: str = "none"
    """Activation checkpointing policy: "none" | "selective" | "full" (or the user's fixed one)."""
    compile: bool = False

    @property
    def offload_level(self) -> str:
        """The memory estimator's offload name."""
        if self.offload_param != "none":
            return "optimizer+param"
        return "optimizer" if self.offload_optimizer != "none" else "none"

    def suffix(self) -> str:
        parts = ""
        if self.offload_optimizer != "none":
            parts += f"_oo{self.offload_optimizer}"
        if self.offload_param != "none":
            parts += f"_op{self.offload_param}"
        parts += AC_SHORT.get(self.ac, f"_ac{self.ac}")
        return parts + ("_cmp" if self.compile else "")

    def describe(self) -> str:
        text = f"stage {self.stage}"
        if self.offload_level != "none":
            text += f", offload {self.offload_level}={self.offload_param if self.offload_param != 'none' else self.offload_optimizer}"
        if self.ac != "none":
            text += f", ac {self.ac}"
        return text + (", compile" if self.compile else "")


@dataclass(frozen=True)
class Experiment:
    """One trial: a choice, a micro batch and the accumulation that goes with it."""

    choice: Choice
    micro_batch: int
    grad_accum: int
    world_size: int

    @property
    def train_batch_size(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def name(self) -> str:
        """DeepSpeed-style folder name, e.g. ``z2_tmbspg4_gas2`` (+ ``_oocpu``, ``_acfull``, ...)."""
        return (f"z{self.choice.stage}_tmbspg{self.micro_batch}_gas{self.grad_accum}"
                + self.choice.suffix())


def _choices_of(value: Any, options: List[Any], missing: List[Any], key: str) -> List[Any]:
    if value is None:
        return list(missing)
    if is_auto(value) or value == "all":
        return list(options)
    if isinstance(value, list):
        bad = [v for v in value if v not in options]
        if bad or not value:
            raise ConfigError(f"{key} = {value!r}: every entry must be one of {options}")
        return list(value)
    if value not in options:
        raise ConfigError(f"{key} = {value!r} is not one of {options} (or \"auto\")")
    return [value]


def _offload_choices(section: Any, key: str) -> List[str]:
    if section is None or section is False:
        return ["none"]
    if is_auto(section):
        return ["none", "cpu"]
    if not isinstance(section, dict):
        raise ConfigError(f"zero_optimization.{key} = {section!r} must be an object "
                          f"{{\"device\": \"cpu\"}} or \"auto\"")
    device = section.get("device", "none")
    if is_auto(device):
        return ["none", "cpu"] + (["nvme"] if section.get("nvme_path") else [])
    return [str(device).lower()]


@dataclass
class TuningSpace:
    """The open dimensions of one user config, and how to turn a point into a ds_config."""

    user_config: Dict[str, Any]
    world_size: int
    stages: List[int]
    offload_optimizer: List[str]
    offload_param: List[str]
    ac_policies: List[str]
    compile: List[bool]
    micro_batches: List[int]
    fixed_train_batch: Optional[int] = None
    """The user's fixed train_batch_size: the accumulation holds it."""
    fixed_grad_accum: int = 1
    tuned_keys: List[str] = field(default_factory=list)

    def choices(self) -> List[Choice]:
        """Every valid combination, in grid order (cheap and plain first)."""
        out = []
        for stage in self.stages:
            for oo in self.offload_optimizer:
                for op in self.offload_param:
                    if (oo != "none" and stage == 0) or (op != "none" and (stage != 3 or oo == "none")):
                        continue
                    for ac in self.ac_policies:
                        for comp in self.compile:
                            out.append(Choice(stage, oo, op, ac, comp))
        return out

    def grad_accum_for(self, micro_batch: int) -> Optional[int]:
        """The accumulation for ``micro_batch`` (None when it cannot hold the global batch)."""
        if self.fixed_train_batch is None:
            return self.fixed_grad_accum
        per_step = micro_batch * self.world_size
        if self.fixed_train_batch % per_step:
            return None
        return self.fixed_train_batch // per_step

    def experiments(self, choice: Choice) -> List[Experiment]:
        """The micro batch candidates of ``choice``, ascending."""
        out = []
        for mbs in self.micro_batches:
            gas = self.grad_accum_for(mbs)
            if gas is not None and gas >= 1:
                out.append(Experiment(choice, mbs, gas, self.world_size))
        return out

    def grid_size(self) -> int:
        return sum(len(self.experiments(c)) for c in self.choices())

    def ds_config(self, exp: Experiment, autotuning: Dict[str, Any]) -> Dict[str, Any]:
        """The user's config with ``exp``'s values in place of the tuned ones."""
        cfg = copy.deepcopy(self.user_config)
        cfg["train_micro_batch_size_per_gpu"] = exp.micro_batch
        cfg["gradient_accumulation_steps"] = exp.grad_accum
        cfg["train_batch_size"] = exp.train_batch_size
        zero = cfg.get("zero_optimization")
        zero = dict(zero) if isinstance(zero, dict) else {}
        zero["stage"] = exp.choice.stage
        for key, device in (("offload_optimizer", exp.choice.offload_optimizer),
                            ("offload_param", exp.choice.offload_param)):
            old = zero.pop(key, None)
            if device != "none":
                section = {k: v for k, v in old.items() if not is_auto(v)} if isinstance(old, dict) else {}
                section["device"] = device
                zero[key] = section
        cfg["zero_optimization"] = zero
        ac = cfg.pop("activation_checkpointing", None)
        if exp.choice.ac != "none":
            ac = dict(ac) if isinstance(ac, dict) else {}
            ac["policy"] = exp.choice.ac
            cfg["activation_checkpointing"] = ac
        elif isinstance(ac, dict) and not is_auto(ac.get("policy")) and not ac.get("modules"):
            cfg["activation_checkpointing"] = ac  # a section that checkpoints nothing stays
        comp = cfg.get("compile")
        comp = {k: v for k, v in comp.items() if not is_auto(v)} if isinstance(comp, dict) else {}
        if exp.choice.compile or comp or "compile" in self.tuned_keys:
            comp["enabled"] = exp.choice.compile
            cfg["compile"] = comp
        cfg["autotuning"] = autotuning
        return cfg


def _micro_batches(value: Any, at: Any) -> Tuple[List[int], bool]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value], False
    if isinstance(value, list):
        if not value or not all(isinstance(v, int) and v >= 1 for v in value):
            raise ConfigError(f"train_micro_batch_size_per_gpu = {value!r}: a list must hold "
                              f"positive integers, e.g. [1, 2, 4]")
        return sorted(set(value)), True
    if value is not None and not is_auto(value):
        raise ConfigError(f"train_micro_batch_size_per_gpu = {value!r} must be an integer, a "
                          f"list or \"auto\"")
    lo, hi = at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu
    sizes, m = [], lo
    while m <= hi:
        sizes.append(m)
        m *= 2
    return sizes, True


def _ac_choices(section: Any) -> List[str]:
    if not isinstance(section, dict):
        if is_auto(section):
            raise ConfigError("activation_checkpointing = \"auto\" does not say which modules to "
                              "checkpoint; write {\"policy\": \"auto\", \"modules\": "
                              "[\"LlamaDecoderLayer\"]} (your block class names)")
        return ["none"]
    policy = section.get("policy")
    if isinstance(policy, list):  # e.g. ["none", "full"]: those policies only
        allowed = ["none", "selective", "full", "selective_ops", "offload"]
        bad = [p for p in policy if p not in allowed]
        if bad or not policy or not section.get("modules"):
            raise ConfigError(f"activation_checkpointing.policy = {policy!r}: a list holds policies "
                              f"from {allowed} and needs activation_checkpointing.modules")
        return list(policy)
    if is_auto(policy):
        if not section.get("modules"):
            raise ConfigError("activation_checkpointing.policy = \"auto\" needs "
                              "activation_checkpointing.modules (the block class names to "
                              "checkpoint, e.g. [\"LlamaDecoderLayer\"])")
        return ["none", "selective", "full"]
    return [str(policy or "full")] if section.get("modules") else ["none"]


def build_space(user_config: Dict[str, Any], at: Any, world_size: int) -> TuningSpace:
    """Read the open dimensions of ``user_config`` (``at``: its AutotuningConfig)."""
    zero = user_config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        zero = {}
    stages = _choices_of(zero.get("stage"), [0, 1, 2, 3], [0], "zero_optimization.stage")
    micro, micro_tuned = _micro_batches(user_config.get("train_micro_batch_size_per_gpu"), at)
    comp = user_config.get("compile")
    comp_on = comp.get("enabled") if isinstance(comp, dict) else comp
    compile_choices = [False, True] if is_auto(comp_on) else [bool(comp_on)]
    tbs = user_config.get("train_batch_size")
    gas = user_config.get("gradient_accumulation_steps")
    fixed_tbs = tbs if isinstance(tbs, int) and not isinstance(tbs, bool) else None
    fixed_gas = gas if isinstance(gas, int) and not isinstance(gas, bool) else 1
    if at.max_train_batch_size is not None:
        micro = [m for m in micro if m * fixed_gas * world_size <= at.max_train_batch_size]
    micro = [m for m in micro if m * fixed_gas * world_size >= at.min_train_batch_size or fixed_tbs]
    space = TuningSpace(
        user_config=user_config, world_size=world_size, stages=stages,
        offload_optimizer=_offload_choices(zero.get("offload_optimizer"), "offload_optimizer"),
        offload_param=_offload_choices(zero.get("offload_param"), "offload_param"),
        ac_policies=_ac_choices(user_config.get("activation_checkpointing")),
        compile=compile_choices, micro_batches=micro, fixed_train_batch=fixed_tbs,
        fixed_grad_accum=fixed_gas)
    names = {"zero_optimization.stage": len(stages) > 1, "train_micro_batch_size_per_gpu": micro_tuned,
             "offload_optimizer": len(space.offload_optimizer) > 1,
             "offload_param": len(space.offload_param) > 1,
             "activation_checkpointing.policy": len(space.ac_policies) > 1,
             "compile": len(compile_choices) > 1}
    space.tuned_keys = [k for k, on in names.items() if on]
    if not space.choices() or not any(space.experiments(c) for c in space.choices()):
        raise ConfigError(
            f"autotuning: the space is empty: no micro batch in {micro or '[]'} gives "
            f"train_batch_size={fixed_tbs} with world size {world_size}; widen "
            f"autotuning.min/max_train_micro_batch_size_per_gpu or change train_batch_size")
    return space

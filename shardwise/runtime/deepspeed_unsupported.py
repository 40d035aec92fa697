"""The parts of DeepSpeed's ``DeepSpeedEngine`` surface that shardwise does not implement.

Each name maps to why it is missing and what to do instead. Methods become stubs on the
engine class (so ``hasattr`` holds and the call raises); attributes are answered by the
engine's ``__getattr__`` before it forwards to the wrapped module. Either way the user gets
an ``UnsupportedFeatureError`` naming the method, never an ``AttributeError`` or a module
attribute that happens to share the name. docs/engine_api.md lists the whole surface.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, NoReturn

from ..errors import UnsupportedFeatureError


@dataclass(frozen=True)
class Missing:
    """Why a DeepSpeed engine name is not implemented, and the way to get the same result."""

    why: str
    """The reason, one clause (no trailing period)."""
    instead: str
    """What to do instead, one clause (no trailing period)."""


_REDUCE = Missing("gradient reduction belongs to the ZeRO strategy, which reduces and averages "
                  "gradients inside engine.backward() and engine.step()",
                  "call engine.backward(loss) and engine.step(); for collectives of your own use "
                  "torch.distributed")
_PLD = Missing("progressive layer drop is not implemented",
               "remove the \"progressive_layer_drop\" section (engine.pld_enabled() is False)")
_EIGEN = Missing("eigenvalue-based quantization scheduling is not implemented",
                 "remove the \"eigenvalue\" section (engine.eigenvalue_enabled() is False)")
_DATA_EFF = Missing("DeepSpeed's data efficiency library (curriculum learning, data sampling, "
                    "random-LTD) is not implemented",
                    "order, filter or drop data in your own Dataset/Sampler")
_TIMERS = Missing("DeepSpeed's timer objects are not kept",
                  "set \"wall_clock_breakdown\": true; the step log prints forward/backward/step "
                  "times (engine.timers.totals holds them)")
_COMPILE = Missing("DeepCompile's graph passes are not implemented",
                   "call engine.compile() (plain torch.compile of the module)")
_TP = Missing("tensor parallelism is not implemented (every rank holds the whole model, "
              "sharded by ZeRO)", "use ZeRO stage 3 to shard parameters")
_SP = Missing("sequence parallelism is not implemented",
              "use activation checkpointing (activation_checkpointing.modules) for long sequences")
_MOVE_STATES = Missing("moving optimizer states between devices on demand is not implemented",
                       "set zero_optimization.offload_optimizer {\"device\": \"cpu\"} to keep "
                       "them on the host for the whole run")

#: DeepSpeed engine methods that raise ``UnsupportedFeatureError`` when called.
UNSUPPORTED_METHODS: Dict[str, Missing] = {
    "scale": Missing("shardwise scales the loss inside engine.backward(), which also runs the "
                     "ZeRO hooks around the backward pass", "call engine.backward(loss), not "
                     "engine.scale(loss).backward()"),
    "coalesce_grad_reduction": Missing(
        "coalescing several backward passes into one reduction is not implemented",
        "use gradient_accumulation_steps with one engine.backward() per micro batch (stages "
        "0-1 can also use engine.no_sync())"),
    "clip_fp32_gradients": Missing("clipping happens inside engine.step() on the global norm",
                                   "set \"gradient_clipping\" in the config"),
    "allreduce_gradients": _REDUCE, "allreduce_bucket": _REDUCE, "allreduce_and_copy": _REDUCE,
    "allreduce_no_retain": _REDUCE, "buffered_allreduce_fallback": _REDUCE,
    "sparse_allreduce_no_retain": _REDUCE, "sparse_allreduce_bucket": _REDUCE,
    "sparse_allreduce": _REDUCE, "sparse_all_gather": _REDUCE, "all_gather_scalar": _REDUCE,
    "set_data_post_process_func": Missing("the engine's data loader has no post-processing hook",
                                          "apply the function in your collate_fn"),
    "set_custom_curriculum_learning_schedule": _DATA_EFF, "random_ltd_initialize": _DATA_EFF,
    "curriculum_params_legacy": _DATA_EFF, "data_efficiency_config": _DATA_EFF,
    "data_sampling_config": _DATA_EFF, "curriculum_learning_config": _DATA_EFF,
    "random_ltd_config": _DATA_EFF,
    "pld_params": _PLD, "pld_theta": _PLD, "pld_gamma": _PLD,
    "eigenvalue_verbose": _EIGEN, "eigenvalue_max_iter": _EIGEN, "eigenvalue_tol": _EIGEN,
    "eigenvalue_stability": _EIGEN, "eigenvalue_gas_boundary_resolution": _EIGEN,
    "eigenvalue_layer_name": _EIGEN, "eigenvalue_layer_num": _EIGEN,
    "active_timers": _TIMERS, "get_wall_clock_timers": _TIMERS, "print_forward_breakdown": _TIMERS,
    "get_sequence_parallel_group": _SP,
    "tensor_parallel_config": _TP, "autotp_size": _TP,
    "quantize_training": Missing("quantization-aware training (MoQ) is not implemented",
                                 "train in bf16/fp16 and quantize after training"),
    "amp_params": Missing("NVIDIA Apex AMP is not used",
                          "use \"bf16\", \"fp16\" or \"torch_autocast\" (engine.amp_enabled() "
                          "is False)"),
    "cpuadam_cores_perc": Missing("there is no compiled DeepSpeedCPUAdam; offloaded steps run "
                                  "torch's own CPU optimizer",
                                  "set the CPU step's threads with SHARDWISE_OFFLOAD_THREADS"),
    "zenflow_config": Missing("ZenFlow is not implemented",
                              "use zero_optimization.offload_optimizer.delayed_update"),
    "zeropp_loco_param": Missing("ZeRO++ (LoCo) is not implemented", "use plain ZeRO stages 1-3"),
    "zero_save_muon_momentum_buffer_in_memory": Missing("there is no Muon optimizer",
                                                        "pick an optimizer from shardwise.optim"),
    "checkpoint_serialization_enabled": Missing(
        "checkpoints have one format (safetensors tensors plus JSON metadata)",
        "nothing to choose; `shardwise convert` exports other formats"),
    "log_level": Missing("there is no log_level config key",
                         "set the level of the \"shardwise\" logger with the logging module"),
    "load_moe_state_dict": Missing("mixture-of-experts (expert parallelism) is not implemented",
                                   "load dense checkpoints with engine.load_checkpoint()"),
    "offload_states": _MOVE_STATES, "reload_states": _MOVE_STATES,
    "get_autosp_backend": _COMPILE, "get_autotp_backend": _COMPILE,
    "get_deepcompile_backend": _COMPILE, "get_deepspeed_compile_backend": _COMPILE,
    "register_compile_pass": _COMPILE,
    "get_compile_time": Missing("compile time is not recorded",
                                "time the first steps after engine.compile() yourself"),
}

#: DeepSpeed engine attributes (not methods) whose access raises ``UnsupportedFeatureError``.
UNSUPPORTED_ATTRIBUTES: Dict[str, Missing] = {
    "tput_timer": _TIMERS,
    "checkpoint_engine": Missing("checkpoints are always written by shardwise's own writer",
                                 "use engine.save_checkpoint() / engine.load_checkpoint()"),
    "seq_parallel_group": _SP,
    "random_ltd_scheduler": _DATA_EFF,
}


def unsupported_error(name: str, call: bool) -> UnsupportedFeatureError:
    """The error for DeepSpeed engine name ``name`` (a method when ``call``, else an attribute)."""
    missing = UNSUPPORTED_METHODS.get(name) or UNSUPPORTED_ATTRIBUTES[name]
    shown = f"engine.{name}()" if call else f"engine.{name}"
    return UnsupportedFeatureError(f"{shown} is not supported in shardwise: {missing.why}. "
                                   f"Instead: {missing.instead}. (docs/engine_api.md lists "
                                   f"DeepSpeed's engine methods and their shardwise status.)")


def _stub(name: str) -> Callable[..., NoReturn]:
    def method(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise unsupported_error(name, call=True)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"DeepSpeed's ``{name}``: not supported in shardwise (raises " \
                     f"UnsupportedFeatureError saying what to do instead)."
    return method


class UnsupportedSurfaceMixin:
    """One raising stub per name of ``UNSUPPORTED_METHODS`` (installed below)."""


for _name in UNSUPPORTED_METHODS:
    setattr(UnsupportedSurfaceMixin, _name, _stub(_name))
del _name

"""Top-level DeepSpeed keys that shardwise accepts and does not act on, each with the reason.

A DeepSpeed config must load unchanged, so these keys are kept verbatim (as dicts or
scalars, see ``ShardwiseConfig``) and produce one warning each saying why nothing happens.
A section that is explicitly switched off (``"enabled": false``, ``false``, a size of 1)
produces no warning: the user asked for nothing and gets nothing.
"""
from __future__ import annotations

from typing import Any, Dict, List

#: key -> why it has no effect in shardwise (and what to use instead).
IGNORED_SECTIONS: Dict[str, str] = {
    "autotuning": "there is no autotuner; use `shardwise report` and the memory estimators",
    "elasticity": "batch sizes come from train_batch_size / train_micro_batch_size_per_gpu / "
                  "gradient_accumulation_steps; the launcher's elastic agent restarts jobs",
    "compression_training": "DeepSpeed Compression needs its own kernels and is not implemented",
    "data_efficiency": "curriculum / data-routing recipes are not implemented",
    "curriculum_learning": "curriculum learning is not implemented; order your data yourself",
    "sparse_attention": "block-sparse attention needs Triton/CUDA kernels (nothing is compiled "
                        "here); use torch.nn.functional.scaled_dot_product_attention",
    "pipeline": "pipeline parallelism is not implemented (data parallel + ZeRO only)",
    "amp": "NVIDIA Apex is not used; use \"bf16\", \"fp16\" or \"torch_autocast\"",
    "zero_force_ds_cpu_optimizer": "offloaded optimizer steps always run torch's own CPU optimizer "
                                   "(there is no compiled DeepSpeedCPUAdam)",
    "hybrid_engine": "the RLHF hybrid train/inference engine is not implemented",
    "eigenvalue": "eigenvalue-based quantization scheduling is not implemented",
    "progressive_layer_drop": "progressive layer dropping is not implemented",
    "quantize_training": "quantization-aware training (MoQ) is not implemented",
    "weight_quantization": "weight quantization is not implemented",
    "nebula": "the Azure Nebula checkpoint service is not supported; checkpoints go to disk",
    "graph_harvesting": "CUDA graph capture is not implemented",
    "timers": "timing is controlled by wall_clock_breakdown",
    "disable_allgather": "parameters are always gathered with all-gather after the step",
    "fp32_allreduce": "use \"communication_data_type\": \"fp32\"",
    "sparse_gradients": "gradients are always reduced densely",
    "vocabulary_size": "only used by DeepSpeed for a tensor-core alignment hint",
    "seq_parallel_communication_data_type": "sequence parallelism is not implemented",
    "sequence_parallel_size": "sequence parallelism is not implemented",
    "use_data_before_expert_parallelism": "expert (MoE) parallelism is not implemented",
    "expert_parallel": "expert (MoE) parallelism is not implemented",
    "tensor_parallel": "training has no tensor parallelism (AutoTP is inference-only: "
                       "shardwise.init_inference); every rank holds the whole model "
                       "(sharded by ZeRO)",
    "inference": "initialize() does not read it; pass inference settings to "
                 "shardwise.init_inference (docs/inference.md)",
    "checkpoint_engine": "checkpoints are always written by shardwise's own writer",
    "monitor_config": "DeepSpeed builds it internally; configure the \"tensorboard\", "
                      "\"csv_monitor\", \"wandb\" and \"comet\" sections instead",
}


def _is_off(name: str, value: Any) -> bool:
    """True when the user explicitly asked for nothing (so a warning would be noise)."""
    if value is None or value is False or value == 0:
        return True
    if isinstance(value, dict):
        if value.get("enabled", True) is False:
            return True
        if name == "tensor_parallel":
            sizes = [value.get(k) for k in ("tp_size", "autotp_size") if k in value]
            return bool(sizes) and all(s in (None, 0, 1) for s in sizes)
    return False


def ignored_section_notes(raw: Dict[str, Any]) -> List[str]:
    """One warning text per ignored top-level key present in ``raw`` and not switched off."""
    notes = []
    for name, reason in IGNORED_SECTIONS.items():
        if name in raw and not _is_off(name, raw[name]):
            notes.append(f"Config key '{name}' is accepted for DeepSpeed compatibility but has "
                         f"no effect in shardwise: {reason}.")
    return notes

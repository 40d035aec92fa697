"""NVMe optimizer offload on a CUDA device: a small Llama trained a few bf16 steps with its
optimizer states in swap files (stages 2 and 3; the masters reach the device from the pinned
ring) ends with the same fp32 masters and weights as the same run with CPU offload, and its
swap folder is gone after ``destroy()``."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS, MICRO, GA, SEQ, VOCAB = 4, 2, 2, 64, 512


def _llama() -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=SEQ)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _train(stage: int, offload: Dict[str, object]) -> Dict[str, Dict[str, torch.Tensor]]:
    import shardwise
    zero = {"stage": stage, "reduce_bucket_size": 200_000, "sub_group_size": 300_000,
            "stage3_param_persistence_threshold": 1000, "offload_optimizer": offload}
    engine, *_ = shardwise.initialize(model=_llama(), config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
        "gradient_clipping": 1.0, "steps_per_print": 0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero})
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS * GA):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g).cuda()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    views = engine.shard_views()
    out = {"master": {v.name: v.master.detach().float().cpu().clone() for v in views
                      if v.master is not None},
           "weight": {v.name: v.weight.detach().float().cpu().clone() for v in views}}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_cuda_nvme_offload_matches_cpu_offload(tmp_path: Path, stage: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = _train(stage, {"device": "cpu", "pin_memory": True})
    nvme = _train(stage, {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
                          "buffer_count": 3})
    assert not (tmp_path / "shardwise_swap").exists()
    for kind in ("master", "weight"):
        assert set(nvme[kind]) == set(cpu[kind])
        for name, want in cpu[kind].items():
            got = nvme[kind][name]
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), \
                f"{kind} {name}: max abs diff {(got - want).abs().max():.3g}"
    # and the run really trained (not a pair of untouched models)
    assert any(not torch.equal(cpu["master"][n], w) for n, w in _initial(stage).items())


def _initial(stage: int) -> Dict[str, torch.Tensor]:
    model = _llama()
    return {n: p.detach().to(torch.bfloat16).float().reshape(-1) for n, p in model.named_parameters()}

"""Inference on Windows: config and checkpoint paths with spaces, the fast path on CPU."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

pytestmark = pytest.mark.windows


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_fast_path_from_a_path_with_spaces(tmp_path):
    import shardwise
    folder = tmp_path / "My Models" / "tiny llama"
    model = _tiny_llama()
    model.save_pretrained(folder)
    config_file = tmp_path / "My Models" / "ds inference.json"
    config_file.write_text(json.dumps({"dtype": "fp32", "replace_with_kernel_inject": True,
                                       "max_out_tokens": 32}))
    with shardwise.OnDevice(device="meta"):
        empty = transformers.AutoModelForCausalLM.from_config(model.config)
    engine = shardwise.init_inference(empty, config=str(config_file), checkpoint=folder)
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=3, eos_token_id=None)
    assert engine.decoder is not None
    assert torch.equal(engine.generate(ids, max_new_tokens=3, eos_token_id=None), ref)

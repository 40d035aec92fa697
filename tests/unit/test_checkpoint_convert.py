"""``shardwise convert``: a sharded checkpoint of a tiny Hugging Face model becomes sharded
safetensors + index that ``from_pretrained`` loads, giving the same logits."""
from __future__ import annotations

import json

import pytest
import torch

from shardwise.checkpoint.consolidate import get_fp32_state_dict, parse_size
from shardwise.checkpoint.convert import main
from shardwise.errors import CheckpointError
from tests.unit.test_checkpoint_format import FakeEngine, write_synthetic

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 3-rank bf16 checkpoint of a trained tiny Llama (fp32 masters differ from bf16 weights)."""
    root = tmp_path_factory.mktemp("ckpt")
    engines = [FakeEngine(_tiny_llama(), r, 3, torch.bfloat16, lr=1e-2) for r in range(3)]
    for e in engines:
        e.train_steps(2, seed=3)
    write_synthetic(root, "global_step2", engines)
    return root


def test_convert_sharded_output_loads_with_from_pretrained(checkpoint, tmp_path):
    out = tmp_path / "hf"
    assert main([str(checkpoint), str(out), "--safe_serialization", "--max_shard_size", "40KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert all((out / s).stat().st_size <= 40_000 + 20_000 for s in shards)  # one tensor may overflow
    assert "lm_head.weight" not in index["weight_map"]  # tied: re-tied by from_pretrained
    assert (out / "config.json").is_file()

    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = _tiny_llama()
    reference.load_state_dict(get_fp32_state_dict(checkpoint), strict=False)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = loaded(ids).logits, reference(ids).logits
    assert torch.equal(got, want)
    untrained = _tiny_llama()
    with torch.no_grad():
        assert not torch.equal(untrained(ids).logits, want)  # the checkpoint really moved weights
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_convert_bf16_single_file_and_errors(checkpoint, tmp_path, capsys):
    out = tmp_path / "bf16"
    assert main([str(checkpoint), str(out), "--dtype", "bf16", "--tag", "global_step2"]) == 0
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert not (out / "model.safetensors.index.json").exists()
    assert main([str(checkpoint), str(tmp_path / "x"), "--tag", "nope"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main([str(tmp_path / "empty"), str(tmp_path / "y")]) == 1
    assert main([str(checkpoint), str(tmp_path / "z"), "--max_shard_size", "lots"]) == 1
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    with pytest.raises(CheckpointError):
        parse_size("0MB")

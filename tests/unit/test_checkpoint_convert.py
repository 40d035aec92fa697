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

import transformers


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


# --- issue 18 bug 4: converting into a folder that holds an earlier export -------------------

@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory):
    """A second checkpoint of the same architecture with other weights (2 ranks, fp32)."""
    root = tmp_path_factory.mktemp("ckpt_b")
    engines = [FakeEngine(_tiny_llama(), r, 2, torch.float32, lr=5e-2) for r in range(2)]
    for e in engines:
        e.train_steps(3, seed=11)
    write_synthetic(root, "global_step3", engines)
    return root


def _logits(model_or_dir, ids):
    if isinstance(model_or_dir, torch.nn.Module):
        model = model_or_dir
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


def _reference(checkpoint_dir):
    model = _tiny_llama()
    model.load_state_dict(get_fp32_state_dict(checkpoint_dir), strict=False)
    return model


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


def _stray_temps(folder):
    return [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name]


def test_convert_into_earlier_export_is_refused_then_replaced_whole(checkpoint, checkpoint_b,
                                                                    tmp_path, capsys):
    """A single-file export, then a sharded one: without --overwrite the folder is refused
    (today the second export lands next to the first and from_pretrained loads the old
    model.safetensors); with it, the folder holds exactly the second export."""
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    want_a, want_b = _logits(_reference(checkpoint), ids), _logits(_reference(checkpoint_b), ids)
    assert not torch.equal(want_a, want_b)
    out = tmp_path / "hf"
    assert main([str(checkpoint), str(out)]) == 0
    assert _files(out) == ["config.json", "model.safetensors"]
    (out / "tokenizer.json").write_text("{}")  # the user's own file, next to the export

    assert main([str(checkpoint_b), str(out), "--max_shard_size", "40KB"]) == 1
    err = capsys.readouterr().err
    assert "already holds an export" in err and "--overwrite" in err and err.count("\n") == 1
    assert torch.equal(_logits(out, ids), want_a)  # untouched

    assert main([str(checkpoint_b), str(out), "--max_shard_size", "40KB", "--overwrite"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert _files(out) == sorted(["config.json", "model.safetensors.index.json",
                                  "tokenizer.json", *shards])
    assert torch.equal(_logits(out, ids), want_b)
    assert _stray_temps(out) == []


def test_convert_overwrite_with_fewer_shards_leaves_no_stale_shards(checkpoint, checkpoint_b,
                                                                     tmp_path):
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    out = tmp_path / "hf"
    assert main([str(checkpoint), str(out), "--max_shard_size", "20KB"]) == 0
    many = len(list(out.glob("model-*.safetensors")))
    assert main([str(checkpoint_b), str(out), "--max_shard_size", "60KB", "--overwrite"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert 1 < len(shards) < many
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == shards
    assert torch.equal(_logits(out, ids), _logits(_reference(checkpoint_b), ids))


def test_failed_convert_leaves_the_earlier_export_untouched(checkpoint, checkpoint_b, tmp_path,
                                                            monkeypatch):
    from shardwise.checkpoint import consolidate
    out = tmp_path / "hf"
    assert main([str(checkpoint), str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def broken(reader, name, dtype):
        calls.append(name)
        if len(calls) == 3:
            raise CheckpointError("disk full (simulated)")
        return real(reader, name, dtype)

    real = consolidate._tensor
    monkeypatch.setattr(consolidate, "_tensor", broken)
    assert main([str(checkpoint_b), str(out), "--overwrite", "--max_shard_size", "40KB"]) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _stray_temps(out) == []

"""checkpoint= (HF dir, sharded HF dir, shardwise training checkpoint), OnDevice(meta), `shardwise generate`."""
import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

import shardwise
from shardwise.cli import main as cli_main
from shardwise.errors import CheckpointError
from tests.unit._inference_models import VOCAB, prompts, tiny

WORDS = ["<pad>", "<unk>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built here (no hub download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="</s>")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny("llama")
    root = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(root)
    _tokenizer().save_pretrained(root)
    sharded = tmp_path_factory.mktemp("hf_llama_sharded")
    model.save_pretrained(sharded, max_shard_size="40KB")
    return model, root, sharded


def _meta_model(root):
    with shardwise.OnDevice(dtype=torch.float32, device="meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root))
    return model


def test_on_device_meta_allocates_no_weights(saved):
    _, root, _ = saved
    model = _meta_model(root)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # rotary tables stay real
    assert not torch.empty(1).is_meta  # the patch is undone on exit


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_checkpoint_hf_dir_loads_onto_meta_model(saved, which):
    ref_model, root, sharded = saved
    path = root if which == "single" else sharded
    assert which == "single" or (sharded / "model.safetensors.index.json").is_file()
    eng = shardwise.init_inference(_meta_model(root), dtype="fp32", checkpoint=str(path),
                                   replace_with_kernel_inject=True, max_out_tokens=64)
    ids, mask = prompts(3)
    ref = ref_model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1, eos_token_id=None)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1, eos_token_id=None)
    assert torch.equal(out, ref)


def test_checkpoint_shardwise_training_dir(tmp_path):
    model = tiny("opt")
    train, *_ = shardwise.initialize(model=copy.deepcopy(model), config={
        "train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}})
    train.save_checkpoint(tmp_path)
    with shardwise.OnDevice(device="meta"):
        empty = AutoModelForCausalLM.from_config(model.config)
    eng = shardwise.init_inference(empty, dtype="fp32", checkpoint=str(tmp_path),
                                   replace_with_kernel_inject=True, max_out_tokens=64)
    ids, mask = prompts(2)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1, eos_token_id=None)
    assert torch.equal(eng.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1,
                                    eos_token_id=None), ref)


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        shardwise.init_inference(tiny("llama"), dtype="fp32", checkpoint=str(tmp_path / "nope"))


def test_shardwise_generate_cli(saved, capsys):
    model, root, _ = saved
    code = cli_main(["generate", str(root), "--prompt", "w1 w2 w3", "--prompt", "w4",
                     "--max-new-tokens", "3", "--dtype", "fp32"])
    assert code == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "fast path: True" in out
    tok = _tokenizer()
    ids = tok(["w1 w2 w3"], return_tensors="pt")["input_ids"]
    ref = model.generate(ids, max_new_tokens=3, pad_token_id=0)
    assert out.splitlines()[0] == tok.decode(ref[0], skip_special_tokens=True)

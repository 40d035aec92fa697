"""ZeRO-Inference through init_inference: decoder layers streamed from pinned host memory or
NVMe (swap files), raw or int8/int4; tokens equal the plain model's generate."""
import copy
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

import shardwise
from shardwise.errors import ConfigError
from shardwise.inference.quant_stream import QuantSpec, quantized_perplexity_delta, roundtrip
from shardwise.inference.weight_store import HostSource, NvmeSource
from tests.unit._inference_models import VOCAB, prompts
from tests.unit.test_inference_config import SEED_4_2


def model(family: str, layers: int = 3, hidden: int = 64, ffn: int = 128, tied: bool = True):
    """Tiny Llama (GQA) / OPT with tied input/output embeddings; ffn 640+ makes layers >= 1 MiB."""
    torch.manual_seed(0)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=tied)
        return LlamaForCausalLM(cfg).eval()
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=hidden, ffn_dim=ffn, num_hidden_layers=layers,
                    num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=hidden)
    return OPTForCausalLM(cfg).eval()


def layer_numel(m) -> int:
    layers = m.model.layers if hasattr(m.model, "layers") else m.model.decoder.layers
    return sum(p.numel() for p in layers[0].parameters())


def zero(m, device="cpu", **extra):
    """Stage 3 + offload_param with a window of one layer ahead (two live layers)."""
    section = {"stage": 3, "offload_param": {"device": device, "pin_memory": True},
               "stage3_param_persistence_threshold": 1000,
               "stage3_max_live_parameters": 2 * layer_numel(m) + 1,
               "stage3_prefetch_bucket_size": 1}
    section["offload_param"].update(extra)
    return section


def reference(m, batch=3, new=5):
    ids, mask = prompts(batch)
    out = m.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=1)
    return ids, mask, out


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("inject", [False, True])
def test_cpu_offload_tokens_equal_plain_generate(family, inject):
    m = model(family)
    ids, mask, ref = reference(m)
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=inject,
                                   zero_optimization=zero(m))
    s = eng.streamer
    assert s.window == 1 and len(s.slots) == 2 and len(s.images) == 3
    assert all(isinstance(img.source, HostSource) for img in s.images)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=1)
    assert torch.equal(out, ref)
    # one fetch of every layer per forward pass (3 layers, 2 slots: nothing stays)
    assert s.stats["fetches"] >= 3 * 5
    # large weights left the module: they point into the device slots between passes
    big = [p for p in eng.module.parameters() if p.numel() > 1000 and p.dim() == 2]
    slot_ptrs = {t.untyped_storage().data_ptr() for t in s.slots}
    layer_params = [p for p in big if p.untyped_storage().data_ptr() in slot_ptrs]
    assert layer_params, "streamed weights should be views of the device slots"


def test_seed_config_verbatim_generates_and_persistent_tensors_stay():
    m = model("llama", layers=2)
    ids, mask, ref = reference(m, batch=1, new=4)
    eng = shardwise.init_inference(copy.deepcopy(m), config=SEED_4_2, dtype="fp32", max_out_tokens=64)
    assert eng.decoder is not None and eng.streamer is not None
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert torch.equal(out, ref)
    # stage3_param_persistence_threshold = 1e5 keeps every tensor of this tiny model resident
    assert all(img.regions == [] for img in eng.streamer.images)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_nvme_offload_swap_files_appear_and_are_removed(family, tmp_path):
    m = model(family, hidden=128, ffn=1024)  # layers >= 1 MiB: DeepSpeed's NVMe minimum
    ids, mask, ref = reference(m, batch=2, new=4)
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                   zero_optimization=zero(m, "nvme", nvme_path=str(tmp_path)))
    s = eng.streamer
    assert all(isinstance(img.source, NvmeSource) for img in s.images)
    files = sorted(Path(s.nvme_dir).glob("*.swp"))
    assert len(files) == 3 and all(f.stat().st_size >= 1 << 20 for f in files)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
    assert torch.equal(out, ref)
    plain = eng.module.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                pad_token_id=1)  # plain HF generate on the streamed module
    assert torch.equal(plain, ref)
    folder = Path(s.nvme_dir)
    s.close()
    assert not folder.exists() and not any(tmp_path.rglob("*.swp"))


def test_small_layers_stay_in_host_memory_with_nvme(tmp_path):
    m = model("llama")
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32",
                                   zero_optimization=zero(m, "nvme", nvme_path=str(tmp_path)))
    assert all(isinstance(img.source, HostSource) for img in eng.streamer.images)
    assert not any(tmp_path.rglob("*.swp"))


@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.25)])  # max |logit error|; |logits| < 1
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_quantized_streaming_within_logit_tolerance(family, bits, tol):
    m = model(family, hidden=64, ffn=128)
    ids, _ = prompts(2)
    ref = m(ids).logits
    wq = {"quantized_initialization": {"num_bits": bits, "group_size": 64}}
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", zero_optimization=zero(m),
                                   weight_quantization=wq)
    s = eng.streamer
    raw = sum(img.image_bytes for img in s.images)
    assert s.bytes_per_pass < raw * (0.3 if bits == 4 else 0.6)  # int4 / int8 over the link
    got = eng(ids).logits
    err = (got - ref).abs().max().item()
    assert 0 < err < tol, err
    out = eng.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=1)
    assert out.shape == (2, ids.shape[1] + 3)


def test_quant_roundtrip_and_perplexity_delta():
    x = torch.randn(4, 128)
    for bits, bound in ((8, 0.02), (4, 0.3)):
        assert (roundtrip(x, QuantSpec(bits, 64)) - x).abs().max() < bound
    m = model("llama", layers=2)
    ids = torch.randint(3, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    r = quantized_perplexity_delta(m, ids, QuantSpec(4, 64), min_numel=1000)
    assert r["ppl_quant"] != r["ppl_float"] and abs(r["relative"]) < 0.2


def test_bad_values_are_errors_naming_them(tmp_path):
    m = model("llama", layers=2)
    with pytest.raises(ConfigError, match="offload_param.device"):
        shardwise.init_inference(m, zero={"stage": 3, "offload_param": {"device": "gpu"}})
    with pytest.raises(ConfigError, match="num_bits"):
        shardwise.init_inference(m, zero_optimization=zero(m), dtype="fp32",
                                 weight_quantization={"quantized_initialization": {"num_bits": 3}})
    with pytest.raises(ConfigError, match="offload_param"):
        shardwise.init_inference(m, dtype="fp32",
                                 weight_quantization={"quantized_initialization": {"num_bits": 4}})
    with pytest.raises(ConfigError, match="nvme_path"):
        shardwise.init_inference(m, zero={"stage": 3, "offload_param": {"device": "nvme"}})


def test_quantized_streaming_when_a_layer_streams_nothing():
    """Every tensor of these small layers is under the persistence threshold, so the layers
    stream nothing; weight_quantization used to fail on the empty layer image (an unbound
    name in the layout, then a group view of zero groups). Nothing is quantized: exact tokens."""
    m = model("llama", layers=2)
    ids, mask, ref = reference(m, batch=2, new=4)
    section = {"stage": 3, "offload_param": {"device": "cpu"},
               "stage3_param_persistence_threshold": layer_numel(m)}
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", zero_optimization=section,
                                   weight_quantization={"quantized_initialization": {"num_bits": 8,
                                                                                     "group_size": 64}})
    assert all(not img.regions for img in eng.streamer.images)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
    assert torch.equal(out, ref)


def test_int8_dtype_on_a_meta_model_streamed_from_its_checkpoint_is_a_clear_error(tmp_path):
    m = model("llama", layers=2)
    m.save_pretrained(tmp_path / "ckpt")
    with shardwise.OnDevice(dtype=torch.float32, device="meta"):
        empty = type(m)(m.config)
    with pytest.raises(ConfigError, match="weight_quantization.*num_bits.*8"):
        shardwise.init_inference(empty, dtype="int8", checkpoint=str(tmp_path / "ckpt"),
                                 zero_optimization=zero(m))


@pytest.mark.parametrize("family,where", [("opt", "cpu"),
                                          pytest.param("llama", "nvme", marks=pytest.mark.windows)])
def test_meta_model_streams_from_checkpoint_layer_by_layer(family, where, tmp_path, monkeypatch):
    m = model(family, hidden=128, ffn=1024)
    m.save_pretrained(tmp_path / "ckpt")
    ids, mask, ref = reference(m, batch=2, new=4)
    with shardwise.OnDevice(dtype=torch.float32, device="meta"):
        empty = type(m)(m.config)

    def whole_model_load(*args, **kwargs):
        raise AssertionError("the checkpoint must be read layer by layer, not loaded whole")
    monkeypatch.setattr("shardwise.inference.engine.load_into", whole_model_load)
    extra = {"nvme_path": str(tmp_path / "swap")} if where == "nvme" else {}
    eng = shardwise.init_inference(empty, dtype="fp32", checkpoint=str(tmp_path / "ckpt"),
                                   replace_with_kernel_inject=True,
                                   zero_optimization=zero(m, where, **extra))
    assert eng.decoder is not None and not any(p.is_meta for p in eng.module.parameters())
    if where == "nvme":
        assert all(isinstance(img.source, NvmeSource) for img in eng.streamer.images)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
    assert torch.equal(out, ref)
    plain = eng.module.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                pad_token_id=1)
    assert torch.equal(plain, ref)


def test_auto_batch_size_fills_free_memory_and_runs(monkeypatch):
    from shardwise.inference import zero_inference as zi
    m = model("llama")
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                   zero_optimization=zero(m), max_out_tokens=256)
    per_seq = zi.bytes_per_sequence(m.config, 16, 8, torch.float32)
    assert per_seq >= 2 * 3 * 2 * 16 * 128 * 4  # the KV cache of 3 layers, 2 KV heads, 128 slots
    monkeypatch.setattr(zi, "_free_bytes", lambda device: 10 * per_seq)
    batch = zi.auto_batch_size(eng, 16, 8)
    assert batch == 9
    ids = torch.randint(3, VOCAB, (batch, 16), generator=torch.Generator().manual_seed(0))
    out = eng.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=1)
    ref = m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=1)
    assert torch.equal(out, ref)


@pytest.mark.windows  # swap files through the IO layer's Windows path, a folder with spaces
def test_nvme_streaming_path_with_spaces(tmp_path):
    m = model("llama", layers=2, hidden=128, ffn=1024)
    ids, mask, ref = reference(m, batch=1, new=3)
    folder = tmp_path / "swap dir with spaces"
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32",
                                   zero_optimization=zero(m, "nvme", nvme_path=str(folder)))
    assert all(isinstance(img.source, NvmeSource) for img in eng.streamer.images)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=1)
    assert torch.equal(out, ref)
    eng.streamer.close()
    assert not any(folder.rglob("*.swp"))


def test_meta_model_with_random_weights_is_built_layer_by_layer_int4():
    """The 70B benchmark's route: a meta model whose layers are made one at a time by
    RandomWeights straight into the int4 host store; the model is never whole anywhere."""
    from shardwise.inference.engine import InferenceEngine
    from shardwise.inference.config import load_inference_config
    from shardwise.inference.weight_store import RandomWeights
    m = model("llama", layers=3, hidden=128, ffn=256)
    with shardwise.OnDevice(dtype=torch.float32, device="meta"):
        empty = type(m)(m.config)
    cfg = load_inference_config(None, dtype="fp32", replace_with_kernel_inject=True,
                                zero_optimization=zero(m),
                                weight_quantization={"quantized_initialization": {"num_bits": 4}})
    eng = InferenceEngine(empty, cfg, layer_weights=RandomWeights(std=0.05, seed=3, device="cpu"))
    assert eng.decoder is not None and not any(p.is_meta for p in eng.module.parameters())
    s = eng.streamer
    assert s.bytes_per_pass < 0.3 * sum(img.image_bytes for img in s.images)  # int4 host copies
    norm = eng.module.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    emb = eng.module.model.embed_tokens.weight
    assert 0.04 < emb.std().item() < 0.06
    ids, mask = prompts(2)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
    plain = eng.module.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                pad_token_id=1)
    assert torch.equal(out, plain)
    with pytest.raises(ConfigError, match="layer_weights"):
        InferenceEngine(type(m)(m.config), load_inference_config(None, dtype="fp32"),
                        layer_weights=RandomWeights(device="cpu"))

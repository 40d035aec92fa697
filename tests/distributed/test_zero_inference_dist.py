"""ZeRO-Inference at world size 2 (gloo): each rank holds half of every streamed layer and the
ranks all-gather it per fetch (with kv_offload too: each rank's cache in its host memory);
tokens equal the plain model's generate on both ranks."""
import copy
import tempfile

import torch

import shardwise
from tests.dist_utils import run_distributed
from tests.unit._inference_models import prompts
from tests.unit.test_zero_inference import model, zero


def _worker(rank, world_size, nvme_root):
    m = model("llama", hidden=128, ffn=2048)
    ids, mask = prompts(2)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
    results = {}
    for where in ("cpu", "nvme", "cpu+kv_offload"):
        extra = {"nvme_path": nvme_root} if where == "nvme" else {}
        eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                       zero=zero(m, where.split("+")[0], **extra),
                                       kv_offload=where.endswith("kv_offload"))
        s = eng.streamer
        out = eng.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
        plain = eng.module.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                    pad_token_id=1)
        results[where] = {"equal": torch.equal(out, ref) and torch.equal(plain, ref),
                          "shard": [img.shard_bytes for img in s.images],
                          "whole": [img.transfer_bytes for img in s.images],
                          "sources": [type(img.source).__name__ for img in s.images],
                          "swap_dir": s.nvme_dir}
        s.close()
    return results


def test_two_ranks_stream_half_each_and_match_generate():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_worker, 2, root)
    assert results[0]["nvme"]["swap_dir"] != results[1]["nvme"]["swap_dir"]  # one folder per rank
    for res in results:
        for where, r in res.items():
            assert r["equal"], where
            assert all(2 * sh >= wh and sh < 0.6 * wh for sh, wh in zip(r["shard"], r["whole"]))
        # 3.3 MiB layers: each rank's half is above DeepSpeed's 1 MiB NVMe minimum
        assert set(res["nvme"]["sources"]) == {"NvmeSource"}


def _both_routes_worker(rank, world_size, nvme_root):
    """Llama (GQA) and OPT, tied embeddings: DeepSpeed's route (``initialize`` without an
    optimizer, stage 3 + offload_param, then the module's own ``generate``) and, for OPT, the
    ``init_inference`` route (the Llama one is the test above), with cpu and nvme."""
    results = {}
    for family in ("llama", "opt"):
        m = model(family, hidden=128, ffn=4096)
        ids, mask = prompts(2)
        gen = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
        ref = m.generate(ids, **gen)
        for where in ("cpu", "nvme"):
            offload = {"device": where, "pin_memory": True}
            if where == "nvme":
                offload["nvme_path"] = f"{nvme_root}/{family}_init"
            config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
                "stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 1000}}
            engine, optimizer, _, _ = shardwise.initialize(model=copy.deepcopy(m), config=config)
            engine.eval()
            with torch.no_grad():
                out = engine.module.generate(ids, synced_gpus=True, **gen)
            swapper = engine.strategy.swapper
            results[f"initialize/{family}/{where}"] = {
                "equal": torch.equal(out, ref), "optimizer": optimizer is None,
                "on_nvme": swapper.on_nvme if swapper is not None else 0}
            engine.destroy()
            if family == "opt":
                extra = {"nvme_path": f"{nvme_root}/{family}_zi"} if where == "nvme" else {}
                eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32",
                                               zero=zero(m, where, **extra))
                out = eng.generate(ids, **gen)
                results[f"init_inference/{family}/{where}"] = {
                    "equal": torch.equal(out, ref), "optimizer": True,
                    "on_nvme": sum(type(img.source).__name__ == "NvmeSource"
                                   for img in eng.streamer.images)}
                eng.streamer.close()
    return results


def test_two_ranks_generate_plain_tokens_through_initialize_and_init_inference():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_both_routes_worker, 2, root)
    for res in results:
        assert len(res) == 6
        for name, r in res.items():
            assert r["equal"], name
            assert r["optimizer"], f"{name}: initialize without an optimizer returns None"
            assert (r["on_nvme"] > 0) == name.endswith("/nvme"), (name, r["on_nvme"])

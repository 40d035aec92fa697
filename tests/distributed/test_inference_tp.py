"""AutoTP on gloo with 2 spawned processes: reference tokens on both ranks, half of each projection."""
import copy

import pytest
import torch

from tests.dist_utils import run_distributed


def _tp_worker(rank, world_size):
    return {family: _one_family(family) for family in ("llama", "opt")}


def _one_family(family):
    import shardwise
    from shardwise.errors import ConfigError
    from tests.unit._inference_models import prompts, tiny
    model = tiny(family)
    ids, mask = prompts(3)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=1, eos_token_id=None)
    ref_logits = model(ids, attention_mask=mask).logits
    full = {n: p.numel() for n, p in model.named_parameters()}
    eng = shardwise.init_inference(copy.deepcopy(model), dtype="fp32", tensor_parallel={"tp_size": 2},
                                   replace_with_kernel_inject=True, max_out_tokens=64)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=1, eos_token_id=None)
    logits = eng(ids, attention_mask=mask).logits
    held = {n: p.numel() for n, p in eng.module.named_parameters()}
    errors = []
    for bad in ({"tp_size": 3}, {"tp_size": 4}):
        try:
            shardwise.init_inference(copy.deepcopy(model), dtype="fp32", tensor_parallel=bad)
        except ConfigError as err:
            errors.append(str(err))
    odd = tiny(family)
    odd.config.num_attention_heads = 3  # forged: 3 heads cannot be split over 2 ranks
    if family == "llama":
        odd.config.num_key_value_heads = 3
    try:
        shardwise.init_inference(odd, dtype="fp32", tensor_parallel={"tp_size": 2})
    except ConfigError as err:
        errors.append(str(err))
    keep = mask.bool()
    # int8 weights (the untied Llama head int8 too, replicated): TP gives one process's int8 engine
    int8 = {"dtype": "int8", "replace_with_kernel_inject": True, "max_out_tokens": 64}
    one = shardwise.init_inference(copy.deepcopy(model), config=int8)
    tp8 = shardwise.init_inference(copy.deepcopy(model), config={**int8, "tensor_parallel": {"tp_size": 2}})
    ref8 = one.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=1, eos_token_id=None)
    out8 = tp8.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=1, eos_token_id=None)
    err8 = (tp8(ids, attention_mask=mask).logits - one(ids, attention_mask=mask).logits)[keep].abs().max().item()
    return {"tokens_equal": torch.equal(out, ref), "logit_err": (logits[keep] - ref_logits[keep]).abs().max().item(),
            "full": full, "held": held, "errors": errors, "int8_tokens_equal": torch.equal(out8, ref8),
            "int8_logit_err": err8, "int8_head": type(tp8.module.get_output_embeddings()).__name__}


@pytest.mark.slow
def test_tp2_gives_the_reference_tokens_and_holds_half():
    """Llama (GQA) and OPT in one spawn of 2 gloo ranks (spawning is the slow part)."""
    results = run_distributed(_tp_worker, 2)
    assert [r["llama"]["int8_head"] for r in results] == ["WeightOnlyInt8Linear"] * 2
    assert [r["opt"]["int8_head"] for r in results] == ["Linear"] * 2  # OPT's head is tied: float
    for res in (r[family] for r in results for family in ("llama", "opt")):
        assert res["tokens_equal"]
        assert res["logit_err"] < 1e-4
        assert res["int8_tokens_equal"] and res["int8_logit_err"] < 1e-4
        for name, n in res["full"].items():
            if name.endswith("weight") and any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj",
                                                                   "out_proj", "fc1", "fc2")):
                assert res["held"][name] * 2 == n, name
        assert len(res["errors"]) == 3
        assert "tensor_parallel.tp_size = 3" in res["errors"][0] and "world size 2" in res["errors"][0]
        assert "tensor_parallel.tp_size = 4" in res["errors"][1]
        assert "3 attention heads" in res["errors"][2] and "divide" in res["errors"][2]

"""Stage 3 on one rank without offload: the fp32 master is the shard (no bf16 copy resident).

A gather casts the master into the compute-dtype buffer, as FSDP2's mixed precision does, so
the engine keeps 4 bytes a trained parameter where it kept 6 (a bf16 shard beside the fp32
master). The weights a forward sees, the training result and checkpoints are unchanged."""
from __future__ import annotations

import torch

from tests.distributed._parity import engine_config, global_batches, make_model


def _engine(stage: int, **extra):
    import shardwise
    zero = {"stage3_param_persistence_threshold": 0}
    zero.update(extra.pop("zero", {}))
    cfg = engine_config(stage, 4, 1, 0.0, 1e-2, zero_optimization=zero,
                        bf16={"enabled": True}, **extra)
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    return engine


def _resident_weight_bytes(engine) -> int:
    """Bytes of the distinct storages behind the trained parameters' shards and masters."""
    from shardwise.zero.stage3.partition import record_of
    seen = {}
    for p in engine.module.parameters():
        rec = record_of(p)
        if rec is None:
            continue
        s = rec.storage.tensor().untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    for flat in engine.strategy.flat_master:
        s = flat.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_one_rank_keeps_no_compute_dtype_copy_of_the_weights():
    engine = _engine(3)
    numel = sum(p.numel() for p in make_model().parameters())
    # every parameter of the tiny net is partitioned (threshold 0): fp32 masters only
    assert _resident_weight_bytes(engine) == 4 * numel
    engine.destroy()


def test_forward_sees_the_bf16_cast_of_the_masters_and_training_matches_stage_2():
    seen = {}
    z3 = _engine(3)
    z2 = _engine(2)

    def record(module, args):
        seen[module] = (module.weight.dtype, module.weight.detach().float().clone())

    hook = z3.module.fc2.register_forward_pre_hook(record)
    for x, y in global_batches(4, 4):
        for engine in (z3, z2):
            loss = engine(x.bfloat16(), y.bfloat16())
            engine.backward(loss)
            engine.step()
    hook.remove()
    dtype, weight = seen[z3.module.fc2]
    assert dtype == torch.bfloat16
    # what the last forward used: the master after three steps, rounded to bf16
    from shardwise.zero.stage3.partition import record_of
    assert record_of(z3.module.fc2.weight).storage.dtype == torch.float32
    z3_params = {n: v.float() for n, v in z3.module_state_dict().items()}
    z2_params = {n: v.float() for n, v in z2.module_state_dict().items()}
    for name in z2_params:
        torch.testing.assert_close(z3_params[name], z2_params[name], rtol=0, atol=0)
    # the masters agree with the stage-2 engine's too (fp32, bit for bit)
    z3_masters = torch.cat([m.reshape(-1) for m in z3.strategy.flat_master])
    assert z3_masters.dtype == torch.float32 and z3_masters.numel() == sum(
        v.numel() for v in z2_params.values())
    z3.destroy()
    z2.destroy()


def test_checkpoint_round_trip_keeps_the_masters(tmp_path):
    engine = _engine(3)
    for x, y in global_batches(2, 4):
        engine.backward(engine(x.bfloat16(), y.bfloat16()))
        engine.step()
    before = torch.cat([m.clone() for m in engine.strategy.flat_master])
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.destroy()

    fresh = _engine(3)
    fresh.load_checkpoint(str(tmp_path), tag="t")
    after = torch.cat([m.clone() for m in fresh.strategy.flat_master])
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    x, y = global_batches(1, 4, seed=7)[0]
    with torch.no_grad():
        fresh.eval()
        out = fresh(x.bfloat16(), y.bfloat16())
    assert torch.isfinite(out.float()).all()
    fresh.destroy()


def test_offload_keeps_its_compute_dtype_shards():
    engine = _engine(3, zero={"offload_optimizer": {"device": "cpu"}})
    from shardwise.zero.stage3.partition import record_of
    assert record_of(engine.module.fc2.weight).storage.dtype == torch.bfloat16
    engine.destroy()


def test_a_gqa_llama_trains_like_stage_2():
    """The shapes users have: a tiny HF Llama with grouped-query attention, every weight
    partitioned, stage 3 (masters as shards) against stage 2, bf16, two steps."""
    import shardwise
    from tests.unit._inference_models import tiny

    results = []
    for stage in (3, 2):
        torch.manual_seed(0)
        model = tiny("llama")
        cfg = engine_config(stage, 2, 1, 0.0, 1e-3,
                            zero_optimization={"stage3_param_persistence_threshold": 0},
                            bf16={"enabled": True})
        engine, *_ = shardwise.initialize(model=model, config=cfg)
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        if stage == 3:
            assert _resident_weight_bytes(engine) == 4 * sum(
                p.numel() for p in tiny("llama").parameters())
        results.append({n: v.float() for n, v in engine.module_state_dict().items()})
        engine.destroy()
    z3, z2 = results
    assert z3.keys() == z2.keys()
    for name in z2:
        torch.testing.assert_close(z3[name], z2[name], rtol=0, atol=0)

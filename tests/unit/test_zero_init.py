"""zero.Init, GatheredParameters and register_external_parameter.

World-of-one checks run in this process; the partitioning checks that need several ranks
(memory of a model built under Init, broadcast of a modification, training an Init-built
model through the engine) run in one spawned gloo world of 2.
"""
from __future__ import annotations

import sys

import pytest
import torch

from shardwise.zero.stage3.partition import full_numel, full_shape, record_of
from tests.dist_utils import run_distributed
from tests.distributed._parity import (engine_config, global_batches, make_model, max_rel_diff,
                                       reference_params)

LAYERS, WIDTH = 24, 1024  # ~100 MB of fp32 weights at full size


class Deep(torch.nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(layers)])
        self.scale = torch.nn.Parameter(torch.ones(width))  # a direct parameter of the root

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.scale


def _full(model: torch.nn.Module) -> dict:
    from shardwise.zero import GatheredParameters
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# --- world of one, in process ------------------------------------------------------------
def test_init_context_partitions_and_keeps_the_seeded_values() -> None:
    from shardwise.zero import Init
    torch.manual_seed(5)
    ref = {n: p.detach().clone() for n, p in Deep(3, 8).named_parameters()}
    torch.manual_seed(5)
    with Init():
        model = Deep(3, 8)
    for n, p in model.named_parameters():
        assert p.numel() == 0, f"{n} still holds {p.numel()} elements"
        assert tuple(full_shape(p)) == tuple(ref[n].shape)
    got = _full(model)
    for n, v in ref.items():
        assert torch.equal(got[n], v), n
    assert all(p.numel() == 0 for p in model.parameters()), "GatheredParameters did not release"


def test_module_apply_inside_init_writes_through() -> None:
    from shardwise.zero import Init

    def init_fn(m: torch.nn.Module) -> None:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.constant_(m.weight, 0.25)
            torch.nn.init.zeros_(m.bias)

    with Init():
        model = Deep(2, 6)
        model.apply(init_fn)
    assert torch.nn.Module.apply.__name__ == "apply" and "shardwise" not in \
        torch.nn.Module.apply.__module__, "nn.Module.apply was not restored"
    got = _full(model)
    assert torch.all(got["layers.0.weight"] == 0.25) and torch.all(got["layers.1.bias"] == 0)


def test_init_module_argument_and_gathered_modify() -> None:
    from shardwise.zero import GatheredParameters, Init
    model = Deep(2, 6)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Init(module=model)
    assert all(p.numel() == 0 for p in model.parameters())
    w = model.layers[1].weight
    with GatheredParameters(w, modifier_rank=0):
        assert w.shape == (6, 6)
        w.data.mul_(2.0)
    got = _full(model)
    assert torch.allclose(got["layers.1.weight"], before["layers.1.weight"] * 2)
    assert torch.equal(got["layers.0.weight"], before["layers.0.weight"])
    # without modifier_rank a modification is discarded (DeepSpeed semantics: read only)
    with GatheredParameters([w]):
        w.data.zero_()
    assert torch.allclose(_full(model)["layers.1.weight"], before["layers.1.weight"] * 2)


def test_forward_gathers_and_external_parameter() -> None:
    import torch.nn.functional as F

    from shardwise.zero import Init, register_external_parameter

    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(self.emb(x), self.emb.weight)  # uses the child's weight directly

    torch.manual_seed(0)
    plain = Parent()
    x = torch.randn(3, 4)
    expected = plain(x)
    torch.manual_seed(0)
    with Init():
        model = Parent()
    from shardwise.zero.stage3.hooks import ParamCoordinator
    from shardwise.zero.stage3.partition import owner_of
    coord = ParamCoordinator(model, owner_of(model.emb.weight), prefetch_elems=10,
                             max_live=10**9, max_reuse=0)
    with pytest.raises(RuntimeError):
        model(x)  # the parent reads a released weight: an error, never silent garbage
    register_external_parameter(model, model.emb.weight)
    assert torch.allclose(model(x), expected)
    with torch.no_grad():  # (with gradients the last module's weights stay for backward)
        assert torch.allclose(model(x), expected)
    assert model.emb.weight.numel() == 0
    coord.remove()


@pytest.mark.parametrize("offload_param", [True, False])
def test_modification_during_a_pending_delayed_update_wins(offload_param: bool) -> None:
    """ZeRO-3 DPU: GatheredParameters(modifier_rank=0) while step t's update still runs in the
    background. The edit must survive the pending update reaching the weights (with
    offload_param that update sits in the spare shards, swapped in at the next boundary)."""
    import shardwise
    from shardwise.zero import GatheredParameters
    zero = {"stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu", "delayed_update": True}}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    cfg = engine_config(3, 2, 1, 0.0, 1e-2, zero_optimization=zero)
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    for x, y in global_batches(3, 2):
        engine.backward(engine(x, y))
        engine.step()
    w = engine.module.fc2.weight
    assert engine.strategy.schedule.pending is not None, "no delayed update pending"
    with GatheredParameters(w, modifier_rank=0):
        w.data.fill_(0.25)
    view = next(v for v in engine.shard_views() if v.name == "fc2.weight")  # applies pending
    assert torch.all(view.master == 0.25), view.master
    assert torch.all(_full(engine.module)["fc2.weight"] == 0.25)
    others = _full(engine.module)["fc1.weight"]
    x, y = global_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.shard_views()  # this step's update is pending too (one step late by design)
    assert not torch.equal(_full(engine.module)["fc1.weight"], others), "training stopped"


# --- world of two, spawned ---------------------------------------------------------------
def _honest_rss_start():
    """Peak RSS now, after making RSS track live memory; None where that is not possible.

    glibc raises its mmap threshold after the first large free, so freed per-module
    temporaries then stay in the heap as fragments and RSS overstates what is alive. A
    fixed 1 MiB threshold (M_MMAP_THRESHOLD = -3) returns every large block on free.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import resource
    try:
        if ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20) != 1:
            return None
    except (OSError, AttributeError):
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _world2(rank: int, world: int) -> dict:
    import shardwise
    from shardwise.zero import GatheredParameters, Init
    out: dict = {}
    # 1. memory: build ~100 MB under Init; the full model never exists in this process
    with Init():
        torch.nn.Linear(2, 2)  # warm up: the first Init loads modules, not counted
    rss = _honest_rss_start()
    torch.manual_seed(1)
    with Init():
        deep = Deep(LAYERS, WIDTH)
    if rss is not None:
        import resource
        out["rss_growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024
    out["local"] = {n: (p.numel(), record_of(p).chunk, full_numel(p))
                    for n, p in deep.named_parameters()}
    del deep
    # 2. an Init-built model trains through the engine like an unpartitioned one
    cfg = engine_config(3, 2, 2, 0.05, 1e-2,
                        zero_optimization={"stage3_param_persistence_threshold": 30})
    with Init(config_dict_or_path=cfg):
        model = make_model()
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    for x, y in global_batches(10, 2 * 2 * world):
        for k in range(2):
            lo = (k * world + rank) * 2
            engine.backward(engine(x[lo:lo + 2], y[lo:lo + 2]))
            engine.step()
    out["trained"] = _full(engine.module)
    # 3. GatheredParameters(modifier_rank=0): rank 0's edit wins everywhere, masters follow
    w = engine.module.fc2.weight
    with GatheredParameters(w, modifier_rank=0):
        w.data.fill_(1.0 if rank == 0 else 5.0)
    out["after_modify"] = _full(engine.module)["fc2.weight"]
    view = next(v for v in engine.shard_views() if v.name == "fc2.weight")
    out["master_after_modify"] = view.master.clone() if view.master is not None else None
    return out


def test_init_and_gathered_parameters_world_2() -> None:
    per_rank = run_distributed(_world2, 2)
    full_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    ref = reference_params(10, 8, 1e-2, 0.05)
    for rank, out in enumerate(per_rank):
        for name, (numel, shard, full) in out["local"].items():
            assert numel == 0 and shard == -(-full // 2), (name, numel, shard, full)
        if "rss_growth" in out:
            assert out["rss_growth"] < 0.7 * full_bytes, (
                f"rank {rank}: peak RSS grew by {out['rss_growth'] / 2**20:.0f} MiB while the "
                f"full model is {full_bytes / 2**20:.0f} MiB")
        bad = max_rel_diff(out["trained"], ref)
        assert not bad, f"rank {rank}: {bad}"
        assert torch.all(out["after_modify"] == 1.0)
        if out["master_after_modify"] is not None:
            assert torch.all(out["master_after_modify"] == 1.0)


@pytest.mark.parametrize("kind", ["llama", "opt", "gpt2"])
def test_init_runs_hugging_face_weight_init(kind: str) -> None:
    """A model built from a config under zero.Init gets Hugging Face's own initialisation
    (transformers 5.x runs it through ``smart_apply``, not ``nn.Module.apply``): the same
    seed gives the same weights as a build without zero.Init (issue 18, bug 2)."""
    import transformers
    from shardwise.zero import Init
    from tests.distributed._hf_tiny import build, hf_config
    plain = dict(build(kind).named_parameters())
    with Init():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    got = _full(model)
    assert got.keys() == plain.keys()
    emb = model.get_input_embeddings().weight
    cfg = hf_config(kind)
    std = cfg.init_std if kind == "opt" else cfg.initializer_range
    assert abs(float(got[[n for n, p in model.named_parameters() if p is emb][0]].std()) - std) < std / 4
    different = [n for n in plain if not torch.equal(got[n], plain[n].detach())]
    assert not different, different

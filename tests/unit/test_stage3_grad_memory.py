"""Stage 3 with its gradient partitions on the device: their memory lives only inside an
accumulation window (from its first reduced gradient to the step), as FSDP2's sharded
gradients do, so the peak at the start of a window's backward holds none of them."""
from __future__ import annotations

import torch

from tests.distributed._parity import engine_config, global_batches, make_model


def _engine(ga: int, **zero):
    import shardwise
    zero = {"stage3_param_persistence_threshold": 0, **zero}
    cfg = engine_config(3, 2, ga, 0.0, 1e-2, zero_optimization=zero)
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    return engine


def _grad_bytes(engine) -> int:
    return sum(g.untyped_storage().nbytes() for g in engine.strategy.flat_grad)


def test_gradient_partitions_exist_only_inside_a_window():
    engine = _engine(ga=2)
    numel = sum(p.numel() for p in make_model().parameters())
    seen = []
    engine.module.register_forward_pre_hook(lambda m, a: seen.append(("forward", _grad_bytes(engine))))
    for x, y in global_batches(2, 4):
        for k in range(2):
            loss = engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])
            engine.backward(loss)
            seen.append(("backward", _grad_bytes(engine)))
            engine.step()
            seen.append(("step", _grad_bytes(engine)))
    assert seen[0] == ("forward", 0)  # none before the first gradient
    # window of two micro steps: the second forward runs with the partitions holding the
    # first micro step's gradients; after the boundary's step they are gone again
    assert [b for _, b in seen[:6]] == [0, 4 * numel, 4 * numel, 4 * numel, 4 * numel, 0]
    assert [b for _, b in seen[6:]] == [0, 4 * numel, 4 * numel, 4 * numel, 4 * numel, 0]
    engine.destroy()


class _TwoHeads(torch.nn.Module):
    """A model whose second head is used only when asked (a skipped module)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 16)
        self.a = torch.nn.Linear(16, 4)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x, y, use_b: bool):
        h = torch.relu(self.body(x))
        return torch.nn.functional.mse_loss((self.b if use_b else self.a)(h), y)


def test_a_parameter_without_gradient_in_a_window_steps_with_zero_after_freeing():
    """The partitions come back uninitialised; the step must zero those that got nothing,
    whatever the previous window left there: the same result as plain torch with
    zero gradients for the unused head (AdamW: its weight decays, and its moments decay)."""
    import shardwise
    torch.manual_seed(0)
    model = _TwoHeads()
    ref = _TwoHeads()
    ref.load_state_dict(model.state_dict())
    cfg = engine_config(3, 4, 1, 0.0, 1e-2,
                        zero_optimization={"stage3_param_persistence_threshold": 0})
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(5)
    for use_b in (True, False, False, True):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        engine.backward(engine(x, y, use_b))
        engine.step()
        ref(x, y, use_b).backward()
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = engine.module_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    engine.destroy()


def test_offloaded_partitions_stay_allocated():
    engine = _engine(ga=1, offload_optimizer={"device": "cpu"})
    x, y = global_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    assert _grad_bytes(engine) == 4 * sum(p.numel() for p in make_model().parameters())
    engine.destroy()

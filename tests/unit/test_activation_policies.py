"""checkpointing.apply: full / selective / offload wrapping of unmodified models."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise
from shardwise.errors import ConfigError

ck = shardwise.checkpointing
H = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, 4 * H)
        self.down = nn.Linear(4 * H, H)
        self.drop = nn.Dropout(0.25)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(self.down(F.silu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean()


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _fresh_state():
    ck.configure()
    yield
    ck.configure()


def _step(model: nn.Module, seed: int = 3):
    x = torch.randn(4, 6, H, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    loss = model(x)
    counter = CountMatmuls()
    with counter:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], counter.count


def _base() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("policy", ["full", "selective", "offload"])
def test_policy_gives_plain_gradients_and_keeps_names(policy):
    plain_grads, _ = _step(_base())
    model = _base()
    keys = list(model.state_dict())
    blocks = list(model.blocks)
    result = ck.apply(model, policy, modules=["Block"])
    assert result.wrapped == ("blocks.0", "blocks.1", "blocks.2")
    assert list(model.state_dict()) == keys and list(model.blocks) == blocks
    grads, _ = _step(model)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))
    other, _ = _step(_base(), seed=4)  # dropout is live: another seed differs
    assert not all(torch.equal(a, b) for a, b in zip(plain_grads, other))


def test_selective_recomputes_no_matmul_but_full_does():
    _, plain = _step(_base())
    full = _base()
    ck.apply(full, "full", modules=["Block"])
    _, full_mm = _step(full)
    selective = _base()
    ck.apply(selective, "selective", modules=["Block"])
    _, sel_mm = _step(selective)
    assert full_mm == plain + 2 * 3  # two linears per block run again in backward
    assert sel_mm == plain


def test_offload_policy_accounts_every_saved_activation():
    model = _base()
    ck.apply(model, "offload", modules=["Block"])
    _step(model)
    stats = ck.offload_stats(model)
    assert stats.host_count + stats.offloaded_count > 0
    assert stats.kept_on_device_count == 0 and stats.kept_on_device_bytes == 0
    assert stats.restored_count >= stats.host_count + stats.offloaded_count


def test_no_recompute_in_eval_or_no_grad():
    model = _base()
    ck.apply(model, "full", modules=["Block"])
    _step(model)
    assert [b.calls for b in model.blocks] == [2, 2, 2]  # forward + recompute
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 6, H))
    assert [b.calls for b in model.blocks] == [3, 3, 3]


def test_remove_deepcopy_and_errors():
    model = _base()
    ck.apply(model, "full", modules=["Block"])
    twin = copy.deepcopy(model)  # the bound forward follows the copy
    _step(twin)
    assert [b.calls for b in twin.blocks] == [2, 2, 2] and [b.calls for b in model.blocks] == [0, 0, 0]
    assert ck.apply(model, "full", modules=["Block"]).skipped == ("blocks.0", "blocks.1", "blocks.2")
    assert ck.remove(model) == 3
    _step(model)
    assert [b.calls for b in model.blocks] == [1, 1, 1]
    with pytest.raises(ConfigError, match="Block, Dropout"):
        ck.apply(model, "full", modules=["Decoder"])
    with pytest.raises(ConfigError, match="policy='half'"):
        ck.apply(model, "half", modules=["Block"])


def _tiny_llama():
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   use_cache=False, attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _llama_grads(model):
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renames it activation_checkpointing_enable
def test_hugging_face_llama_default_modules_and_its_own_checkpointing():
    want = _llama_grads(_tiny_llama())
    model = _tiny_llama()
    result = ck.apply(model, "selective")  # modules from _no_split_modules
    assert result.wrapped == ("model.layers.0", "model.layers.1")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, _llama_grads(model)))
    # HF's own gradient_checkpointing_enable() keeps working, and apply() leaves those layers to it.
    hf = _tiny_llama()
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert ck.apply(hf, "full").skipped == ("model.layers.0", "model.layers.1")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, _llama_grads(hf)))


def test_recompute_runs_the_wrapped_modules_hooks_again():
    # ZeRO-3 gathers a module's own parameters in its forward pre-hook: the recompute needs it too.
    model = _base()
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: seen.append(torch.is_grad_enabled()))
    ck.apply(model, "full", modules=["Block"])
    _step(model)
    assert len(seen) == 2 and model.blocks[1].calls == 2


class _Z3Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))  # owned by the wrapped module itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale + x


def zero3_losses(rank: int, world_size: int, block=None, policies=(None, "full", "selective",
                                                                     "offload"), shape=(2, 8)):
    """Losses of 3 ZeRO-3 steps on 2 blocks, per policy (None: no checkpointing)."""
    block = block or _Z3Block
    losses = []
    for policy in policies:
        ac = {} if policy is None else {"modules": [block.__name__], "policy": policy}
        torch.manual_seed(0)
        model = nn.Sequential(block(), block(), nn.Linear(8, 1))
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": 3}, "activation_checkpointing": ac}
        engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            loss = engine(x).sum()
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def test_policies_under_zero3_train_like_no_checkpointing():
    from tests.dist_utils import run_distributed
    for losses in run_distributed(zero3_losses, 2):
        assert losses[1:] == [losses[0]] * 3

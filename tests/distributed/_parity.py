"""Shared pieces of the parity tests: a small model, deterministic data, the torch reference."""
from __future__ import annotations

from typing import Dict, List

import torch

IN, HID, OUT = 12, 24, 6


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HID)
        self.fc2 = torch.nn.Linear(HID, HID)
        self.head = torch.nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        h = torch.tanh(self.fc2(h)) + h
        return torch.nn.functional.mse_loss(self.head(h), y)


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def global_batches(steps: int, global_batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, IN, generator=g), torch.randn(global_batch, OUT, generator=g))
            for _ in range(steps)]


def reference_params(steps: int, global_batch: int, lr: float, clip: float) -> Dict[str, torch.Tensor]:
    """Plain single-process torch: AdamW on the whole global batch each step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for x, y in global_batches(steps, global_batch):
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_config(stage: int, micro: int, ga: int, clip: float, lr: float, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ga,
           "gradient_clipping": clip, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    return cfg


def train_engine(rank: int, world: int, cfg: dict, steps: int) -> Dict[str, torch.Tensor]:
    """Train with shardwise; rank r takes micro batch (k·W + r) of each global batch."""
    import shardwise
    micro, ga = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    model = make_model()
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    for x, y in global_batches(steps, micro * ga * world):
        for k in range(ga):
            lo = (k * world + rank) * micro
            loss = engine(x[lo:lo + micro], y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
    return {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}


def max_rel_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    bad = []
    for k in a:
        if not torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5):
            bad.append(f"{k}: max abs diff {(a[k] - b[k]).abs().max().item():.3e}")
    return bad


def dpu_reference(lrs: List[float], global_batch: int, warmup: int,
                  clip: float = 0.0) -> Dict[str, torch.Tensor]:
    """The delayed parameter update by its definition: fp32 masters w, and the model computes
    at p[t] = w[t-1] once delayed (t >= warmup), else at w[t]:
    w[t+1] = w[t] - u(g(p[t])), with step t at learning rate ``lrs[t]``."""
    model = make_model()
    masters = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=lrs[0], weight_decay=0.01)
    for t, (x, y) in enumerate(global_batches(len(lrs), global_batch)):
        model.zero_grad()
        model(x, y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = [m.clone() for m in masters]
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.clone()
        for group in opt.param_groups:
            group["lr"] = lrs[t]
        opt.step()
        use = before if t >= warmup else masters
        with torch.no_grad():
            for p, v in zip(model.parameters(), use):
                p.copy_(v)
    return {name: m for (name, _), m in zip(model.named_parameters(), masters)}


def causal_lm_reference(model: torch.nn.Module, batches: List[torch.Tensor], micro: int,
                        micro_per_step: int, lr: float, weight_decay: float = 0.01
                        ) -> Dict[str, torch.Tensor]:
    """Plain single-process torch for a Hugging Face causal LM: AdamW once per global batch,
    each ``micro``-row slice its own forward/backward with its loss divided by
    ``micro_per_step`` (GA x world), as the engines' micro batches are."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    for ids in batches:
        for mb in ids.split(micro):
            (model(input_ids=mb, labels=mb).loss / micro_per_step).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}

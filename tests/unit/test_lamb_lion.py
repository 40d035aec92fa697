"""Lamb and Lion against per-element float64 references written out with Python floats."""
import copy
import io
import math

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.optim import Lamb, Lion

STEPS = 5


def _initial_params():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=g, dtype=torch.float64),          # ordinary
        torch.full((5,), 100.0, dtype=torch.float64),                  # ratio > max_coeff
        torch.full((4,), 1e-6, dtype=torch.float64),                   # ratio < min_coeff
        torch.zeros(2, dtype=torch.float64),                           # ||w|| = 0 -> ratio 1
    ]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in [(3, 4), (5,), (4,), (2,)]]


def _lamb_reference(lr, betas, eps, wd, bias_correction, eps_inside_sqrt, max_grad_norm,
                    min_coeff=0.01, max_coeff=10.0):
    b1, b2 = betas
    weights = [p.flatten().tolist() for p in _initial_params()]
    m = [[0.0] * len(w) for w in weights]
    v = [[0.0] * len(w) for w in weights]
    history = []
    for t in range(1, STEPS + 1):
        grads = [g.flatten().tolist() for g in _grads(t)]
        if max_grad_norm > 0:
            total = math.sqrt(sum(x * x for g in grads for x in g))
            clip = (total + 1e-6) / max_grad_norm
            if clip > 1:
                grads = [[x / clip for x in g] for g in grads]
        ratios = []
        for w, mi, vi, g in zip(weights, m, v, grads):
            update = []
            for j in range(len(w)):
                mi[j] = b1 * mi[j] + (1 - b1) * g[j]
                vi[j] = b2 * vi[j] + (1 - b2) * g[j] * g[j]
                mh = mi[j] / (1 - b1 ** t) if bias_correction else mi[j]
                vh = vi[j] / (1 - b2 ** t) if bias_correction else vi[j]
                denom = math.sqrt(vh + eps) if eps_inside_sqrt else math.sqrt(vh) + eps
                update.append(mh / denom + wd * w[j])
            w_norm = math.sqrt(sum(x * x for x in w))
            u_norm = math.sqrt(sum(x * x for x in update))
            ratio = 1.0
            if w_norm != 0 and u_norm != 0:
                ratio = min(max(w_norm / u_norm, min_coeff), max_coeff)
            ratios.append(ratio)
            for j in range(len(w)):
                w[j] -= lr * ratio * update[j]
        history.append(ratios)
    return weights, history


def _step(opt, params, steps, first_step=1):
    for t in range(first_step, first_step + steps):
        for p, g in zip(params, _grads(t)):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("variant", [
    dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, wd=0.01, bias_correction=True,
         eps_inside_sqrt=False, max_grad_norm=0.0),
    dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, wd=0.0, bias_correction=False,
         eps_inside_sqrt=True, max_grad_norm=1.0),
])
def test_lamb_matches_reference(variant):
    expected, ratios = _lamb_reference(**variant)
    params = [p.clone().requires_grad_(True) for p in _initial_params()]
    opt = Lamb(params, lr=variant["lr"], betas=variant["betas"], eps=variant["eps"],
               weight_decay=variant["wd"], bias_correction=variant["bias_correction"],
               eps_inside_sqrt=variant["eps_inside_sqrt"], max_grad_norm=variant["max_grad_norm"])
    _step(opt, params, STEPS)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.detach().flatten(), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-6, atol=1e-12)
    assert opt.get_lamb_coeffs() == pytest.approx(ratios[-1], rel=1e-6)


def test_lamb_trust_ratio_clamps_and_zero_norm():
    _, ratios = _lamb_reference(lr=0.01, betas=(0.9, 0.999), eps=1e-8, wd=0.0,
                                bias_correction=True, eps_inside_sqrt=False, max_grad_norm=0.0)
    # The reference itself exercises each branch the implementation must match.
    assert ratios[0][1] == 10.0 and ratios[0][2] == 0.01 and ratios[0][3] == 1.0
    params = [p.clone().requires_grad_(True) for p in _initial_params()]
    opt = Lamb(params, lr=0.01)
    _step(opt, params, 1)
    assert opt.get_lamb_coeffs()[1:] == pytest.approx([10.0, 0.01, 1.0])


def _lion_reference(lr, betas, wd):
    b1, b2 = betas
    weights = [p.flatten().tolist() for p in _initial_params()]
    m = [[0.0] * len(w) for w in weights]
    for t in range(1, STEPS + 1):
        grads = [g.flatten().tolist() for g in _grads(t)]
        for w, mi, g in zip(weights, m, grads):
            for j in range(len(w)):
                c = b1 * mi[j] + (1 - b1) * g[j]
                sign = (c > 0) - (c < 0)
                w[j] = w[j] * (1 - lr * wd) - lr * sign
                mi[j] = b2 * mi[j] + (1 - b2) * g[j]
    return weights, m


@pytest.mark.parametrize("lr, betas, wd", [(1e-4, (0.9, 0.99), 0.0), (0.01, (0.95, 0.98), 0.1)])
def test_lion_matches_reference(lr, betas, wd):
    expected, momenta = _lion_reference(lr, betas, wd)
    params = [p.clone().requires_grad_(True) for p in _initial_params()]
    opt = Lion(params, lr=lr, betas=betas, weight_decay=wd)
    _step(opt, params, STEPS)
    for p, want, m in zip(params, expected, momenta):
        torch.testing.assert_close(p.detach().flatten(), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["exp_avg"].flatten(),
                                   torch.tensor(m, dtype=torch.float64), rtol=1e-6, atol=1e-12)


def test_lion_defaults_are_the_papers():
    opt = Lion([torch.zeros(1, requires_grad=True)])
    assert opt.defaults == {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}


def test_lamb_defaults_are_fused_lambs():
    d = Lamb([torch.zeros(1, requires_grad=True)]).defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert (d["max_coeff"], d["min_coeff"], d["bias_correction"]) == (10.0, 0.01, True)


@pytest.mark.parametrize("cls, kwargs", [(Lamb, dict(lr=0.01, weight_decay=0.01)),
                                         (Lion, dict(lr=0.01, weight_decay=0.1))])
def test_state_dict_round_trip(cls, kwargs):
    params = [p.clone().requires_grad_(True) for p in _initial_params()]
    opt = cls(params, **kwargs)
    _step(opt, params, 3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    clones = [p.detach().clone().requires_grad_(True) for p in params]
    resumed = cls(clones, **kwargs)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    _step(opt, params, 2, first_step=4)
    _step(resumed, clones, 2, first_step=4)
    for a, b in zip(params, clones):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float(resumed.state[clones[0]]["step"]) == 5.0


def test_params_without_grad_are_skipped_and_float32_works():
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    before = b.detach().clone()
    for cls in (Lamb, Lion):
        opt = cls([a, b], lr=0.1)
        a.grad = torch.randn(4)
        b.grad = None
        opt.step()
        assert torch.equal(b.detach(), before) and b not in opt.state


def test_bad_hyperparameters():
    p = [torch.zeros(1, requires_grad=True)]
    with pytest.raises(ConfigError, match="amsgrad"):
        Lamb(p, amsgrad=True)
    with pytest.raises(ConfigError, match="min_coeff"):
        Lamb(p, min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ConfigError, match="betas"):
        Lion(p, betas=(0.9, 1.5))
    with pytest.raises(ConfigError, match="weight_decay"):
        Lion(p, weight_decay=-1.0)


def test_multiple_groups_use_their_own_lr():
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    opt = Lion([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01}])
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    torch.testing.assert_close(a.detach(), torch.full((3,), 0.9))
    torch.testing.assert_close(b.detach(), torch.full((3,), 0.99))
    assert copy.deepcopy(opt.state_dict())["param_groups"][1]["lr"] == 0.01

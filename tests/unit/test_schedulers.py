"""DeepSpeed LR schedules against their formulas written out here, state round trips, errors."""
import json
import math

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.optim import SCHEDULER_NAMES, build_scheduler

STEPS = 30


def _optimizer(lr=0.1, groups=1, cls=torch.optim.AdamW):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    return cls([{"params": [p]} for p in params], lr=lr)


def _trace(sched, opt, steps=STEPS):
    """lr at construction (iteration -1) then after each of ``steps`` step() calls."""
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr()[0] == opt.param_groups[0]["lr"]
    return lrs


def _warmup(it, W, kind):
    return math.log(it + 1) / math.log(W) if kind == "log" else it / W


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    lo, hi, W = 0.001, 0.01, 10
    opt = _optimizer()
    s = build_scheduler("WarmupLR", opt, {"warmup_min_lr": lo, "warmup_max_lr": hi,
                                          "warmup_num_steps": W, "warmup_type": kind})
    expected = [lo] + [lo + (hi - lo) * (_warmup(it, W, kind) if it < W else 1.0)
                       for it in range(STEPS)]
    assert _trace(s, opt) == pytest.approx(expected, rel=1e-12)


def test_warmup_lr_max_defaults_to_optimizer_lr_and_zero_steps_means_two():
    opt = _optimizer(lr=0.05)
    s = build_scheduler("warmuplr", opt, {"warmup_num_steps": 0})
    # W = max(2, 0) = 2: log(1)/log(2) = 0 at it 0, then held at the max.
    assert _trace(s, opt, 4) == pytest.approx([0.0, 0.0, 0.05, 0.05, 0.05])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    lo, hi, W, total = 0.0, 0.02, 8, 25
    opt = _optimizer()
    s = build_scheduler("WarmupDecayLR", opt, {"warmup_min_lr": lo, "warmup_max_lr": hi,
                                               "warmup_num_steps": W, "total_num_steps": total,
                                               "warmup_type": kind})

    def gamma(it):
        if it < W:
            return _warmup(it, W, kind)
        return max(0.0, (total - it) / max(1, total - W))

    expected = [lo] + [lo + (hi - lo) * gamma(it) for it in range(STEPS)]
    lrs = _trace(s, opt)
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert lrs[-1] == 0.0  # decays to zero and stays there past total_num_steps


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    base, W, total, wmin, cmin = 0.1, 6, 20, 0.1, 0.01
    opt = _optimizer(lr=base)
    s = build_scheduler("WarmupCosineLR", opt, {"total_num_steps": total, "warmup_num_steps": W,
                                                "warmup_min_ratio": wmin, "cos_min_ratio": cmin,
                                                "warmup_type": kind})

    def ratio(it):
        if it < W:
            return wmin + (1 - wmin) * _warmup(it, W, kind)
        progress = min(1.0, (it - W + 1) / (total - W))
        return cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * progress))

    expected = [0.0] + [base * ratio(it) for it in range(STEPS)]
    lrs = _trace(s, opt)
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[-1] == pytest.approx(base * cmin)


def test_one_cycle_lr_and_momentum_with_decay():
    lo, hi, first, second = 0.001, 0.01, 5, 7
    opt = _optimizer()
    s = build_scheduler("OneCycle", opt, {
        "cycle_min_lr": lo, "cycle_max_lr": hi, "cycle_first_step_size": first,
        "cycle_second_step_size": second, "decay_lr_rate": 0.5, "decay_step_size": 2,
        "cycle_min_mom": 0.85, "cycle_max_mom": 0.95})
    total = first + second
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)  # DeepSpeed starts at min momentum

    def scale(it):
        pos = (it + 1) % total
        return pos / first if pos <= first else (total - pos) / second

    expected_lr = [lo]
    expected_mom = [0.85]
    for it in range(STEPS):
        if it < total:
            expected_lr.append(lo + (hi - lo) * scale(it))
            expected_mom.append(0.95 - (0.95 - 0.85) * scale(it))
        else:
            expected_lr.append(lo / (1 + 0.5 * (it - total + 1) / 2))
            expected_mom.append(0.95)  # decay_mom_rate 0: momentum stays at the max
    moms = [opt.param_groups[0]["betas"][0]]
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(STEPS):
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
    assert lrs == pytest.approx(expected_lr, rel=1e-12)
    assert moms == pytest.approx(expected_mom, rel=1e-12)
    assert max(lrs) == pytest.approx(hi)


def test_one_cycle_staircase():
    lo, hi = 0.0, 1.0
    opt = _optimizer()
    s = build_scheduler("OneCycle", opt, {"cycle_min_lr": lo, "cycle_max_lr": hi,
                                          "cycle_first_step_size": 4, "cycle_first_stair_count": 2,
                                          "cycle_momentum": False})

    def stair(it):
        pos = (it + 1) % 8
        if pos <= 4:
            return math.floor(pos * 2 / 4) / 2
        return math.floor((8 - pos) * 2 / 4) / 2

    expected = [lo] + [stair(it) if it < 8 else lo for it in range(12)]
    assert _trace(s, opt, 12) == pytest.approx(expected)
    assert "betas" in opt.param_groups[0] and opt.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    lo, size, rate = 0.01, 4, 0.5
    opt = _optimizer()
    s = build_scheduler("LRRangeTest", opt, {"lr_range_test_min_lr": lo, "lr_range_test_step_size": size,
                                             "lr_range_test_step_rate": rate,
                                             "lr_range_test_staircase": staircase})

    def interval(it):
        x = (it + 1) / size
        return math.floor(x) if staircase else x

    expected = [lo] + [lo * (1 + rate * interval(it)) for it in range(STEPS)]
    assert _trace(s, opt) == pytest.approx(expected, rel=1e-12)


def test_per_group_values():
    opt = _optimizer(groups=2)
    s = build_scheduler("WarmupLR", opt, {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 0.2],
                                          "warmup_num_steps": 4, "warmup_type": "linear"})
    for _ in range(3):
        s.step()
    assert s.get_last_lr() == pytest.approx([0.5, 0.15])


CASES = [
    ("WarmupLR", {"warmup_num_steps": 10}),
    ("WarmupDecayLR", {"warmup_num_steps": 5, "total_num_steps": 40}),
    ("WarmupCosineLR", {"warmup_num_steps": 5, "total_num_steps": 40, "warmup_min_ratio": 0.2}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 6,
                  "decay_lr_rate": 0.1, "decay_step_size": 3}),
    ("LRRangeTest", {"lr_range_test_step_size": 3}),
    ("StepLR", {"step_size": 4, "gamma": 0.5}),
]


@pytest.mark.parametrize("name, params", CASES)
def test_state_dict_round_trip_mid_schedule(name, params):
    opt = _optimizer(lr=0.1)
    s = build_scheduler(name, opt, params)
    for _ in range(13):
        opt.step()
        s.step()
    state = json.loads(json.dumps(s.state_dict()))  # must be plain JSON
    # The resumed optimizer carries the scheduled lr, as a loaded optimizer state would.
    resumed_opt = _optimizer(lr=opt.param_groups[0]["lr"])
    resumed_opt.load_state_dict(opt.state_dict())
    resumed = build_scheduler(name, resumed_opt, params)
    resumed.load_state_dict(state)
    a, b = [], []
    for _ in range(10):
        opt.step()
        s.step()
        resumed_opt.step()
        resumed.step()
        a.append(opt.param_groups[0]["lr"])
        b.append(resumed_opt.param_groups[0]["lr"])
    assert a == pytest.approx(b, rel=1e-12)


def test_explicit_iteration_and_construction_sets_lr():
    opt = _optimizer(lr=1.0)
    s = build_scheduler("WarmupLR", opt, {"warmup_min_lr": 0.25, "warmup_max_lr": 1.0,
                                          "warmup_num_steps": 10, "warmup_type": "linear"})
    assert opt.param_groups[0]["lr"] == 0.25
    s.step(last_batch_iteration=5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25 + 0.75 * 0.5)
    assert s.state_dict() == {"last_batch_iteration": 5}


def test_torch_scheduler_by_name():
    opt = _optimizer(lr=1.0)
    s = build_scheduler("cosineannealinglr", opt, {"T_max": 10})
    assert type(s) is torch.optim.lr_scheduler.CosineAnnealingLR
    assert "StepLR" in SCHEDULER_NAMES and "WarmupLR" in SCHEDULER_NAMES
    assert "LambdaLR" not in SCHEDULER_NAMES


def test_unknown_type_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupCosine", _optimizer(), {})
    msg = str(err.value)
    assert "Did you mean 'WarmupCosineLR'" in msg and "OneCycle" in msg and "LRRangeTest" in msg
    with pytest.raises(ConfigError, match="callable"):
        build_scheduler("LambdaLR", _optimizer(), {})


def test_unknown_kwarg_names_the_key():
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupLR", _optimizer(), {"warmup_steps": 10})
    msg = str(err.value)
    assert "scheduler.params.warmup_steps" in msg and "warmup_num_steps" in msg
    with pytest.raises(ConfigError, match="step_sizee"):
        build_scheduler("StepLR", _optimizer(), {"step_sizee": 3})


@pytest.mark.parametrize("name, params, needle", [
    ("WarmupDecayLR", {"total_num_steps": 50, "warmup_num_steps": 100}, "total_num_steps=50"),
    ("WarmupDecayLR", {"warmup_num_steps": 10}, "total_num_steps"),
    ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 10}, "warmup_num_steps=10"),
    ("WarmupLR", {"warmup_num_steps": -3}, "warmup_num_steps"),
    ("WarmupLR", {"warmup_num_steps": 2.5}, "integer"),
    ("WarmupLR", {"warmup_type": "exp"}, "warmup_type"),
    ("WarmupLR", {"warmup_min_lr": [0.1, 0.2]}, "param groups"),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 2, "cos_min_ratio": 2.0},
     "cos_min_ratio"),
    ("OneCycle", {"cycle_min_lr": 0.1}, "cycle_max_lr"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0},
     "cycle_first_step_size"),
    ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size"),
    ("WarmupLR", {"warmup_max_lr": "auto"}, "auto"),
])
def test_bad_values(name, params, needle):
    with pytest.raises(ConfigError, match=needle):
        build_scheduler(name, _optimizer(), params)

"""DeepSpeed dynamic loss-scale rules, step by step, plus the static scaler and has_overflow.

Expected sequences are derived by hand from DeepSpeed's rule: on overflow, drop the scale
(by 2, floored at min) only when hysteresis is used up, else spend one hysteresis;
without overflow, grow by 2 when (iter - last_overflow_iter) % window == 0 (last starts
at -1) and refill hysteresis then (or on every clean step when consecutive).
"""
import json
from types import SimpleNamespace

import pytest
import torch

from shardwise.errors import ConfigError, ShardwiseError
from shardwise.precision import (DynamicLossScaler, LossScaleUnderflowError, StaticLossScaler,
                                 create_loss_scaler, has_overflow)


def _run(scaler, flags):
    scales, hysteresis = [], []
    for flag in flags:
        scaler.update_scale(flag)
        scales.append(scaler.cur_scale)
        hysteresis.append(scaler.cur_hysteresis)
    return scales, hysteresis


def test_hysteresis_1_window_2():
    s = DynamicLossScaler(init_scale=16, scale_window=2, min_scale=1, delayed_shift=1)
    scales, _ = _run(s, [False, False, False, True, False, False, False])
    assert scales == [16, 32, 32, 16, 16, 32, 32]
    assert s.last_overflow_iter == 3 and s.cur_iter == 7


def test_hysteresis_2_window_3_not_consecutive():
    s = DynamicLossScaler(init_scale=16, scale_window=3, min_scale=1, delayed_shift=2,
                          consecutive_hysteresis=False)
    scales, hyst = _run(s, [True, True, False, True, False, False, False, True, True])
    assert scales == [16, 8, 8, 4, 4, 4, 8, 8, 4]
    # Hysteresis only refills when the scale grows (iteration 6).
    assert hyst == [1, 1, 1, 1, 1, 1, 2, 1, 1]


def test_hysteresis_2_window_3_consecutive():
    s = DynamicLossScaler(init_scale=16, scale_window=3, min_scale=1, delayed_shift=2,
                          consecutive_hysteresis=True)
    scales, hyst = _run(s, [True, True, False, True, False, False, False, True, True])
    assert scales == [16, 8, 8, 8, 8, 8, 16, 16, 8]
    assert hyst == [1, 1, 2, 1, 2, 2, 2, 1, 1]


def test_min_scale_clamp_without_raise():
    s = DynamicLossScaler(init_scale=4, scale_window=100, min_scale=3, delayed_shift=1,
                          raise_error_at_min_scale=False)
    scales, _ = _run(s, [True, True, True])
    assert scales == [3, 3, 3]


def test_raise_at_min_scale():
    s = DynamicLossScaler(init_scale=4, scale_window=100, min_scale=2, delayed_shift=1)
    s.update_scale(True)
    assert s.cur_scale == 2
    with pytest.raises(LossScaleUnderflowError) as err:
        s.update_scale(True)
    assert isinstance(err.value, ShardwiseError)
    msg = str(err.value)
    assert "min_loss_scale=2" in msg and "bf16" in msg


def test_hysteresis_spent_before_raising_at_min():
    s = DynamicLossScaler(init_scale=2, scale_window=100, min_scale=2, delayed_shift=2)
    s.update_scale(True)  # spends hysteresis, no raise even though the scale is at min
    assert (s.cur_scale, s.cur_hysteresis) == (2, 1)
    with pytest.raises(LossScaleUnderflowError):
        s.update_scale(True)


def test_static_scaler_never_changes():
    s = StaticLossScaler(128.0)
    for flag in (True, False, True):
        s.update_scale(flag)
    assert s.cur_scale == s.loss_scale == 128.0 and not s.dynamic
    assert float(s.scale_loss(torch.tensor(2.0))) == 256.0
    json.dumps(s.state_dict())


def test_create_loss_scaler_from_config_like_objects():
    cfg = SimpleNamespace(loss_scale=0, initial_scale_power=8, loss_scale_window=50, hysteresis=3,
                          consecutive_hysteresis=True, min_loss_scale=0.5)
    s = create_loss_scaler(cfg)
    assert isinstance(s, DynamicLossScaler) and s.dynamic
    assert (s.cur_scale, s.scale_window, s.delayed_shift, s.cur_hysteresis) == (256.0, 50, 3, 3)
    assert s.consecutive_hysteresis and s.min_scale == 0.5 and s.loss_scale == 256.0
    # DeepSpeed's defaults when keys are omitted.
    d = create_loss_scaler({"loss_scale": 0})
    assert (d.cur_scale, d.scale_window, d.delayed_shift, d.min_scale) == (2.0 ** 16, 1000, 2, 1.0)
    static = create_loss_scaler({"loss_scale": 1024})
    assert isinstance(static, StaticLossScaler) and static.cur_scale == 1024.0


@pytest.mark.parametrize("cfg, key", [({"loss_scale": 0, "hysteresis": 0}, "hysteresis"),
                                      ({"loss_scale": 0, "loss_scale_window": 0}, "loss_scale_window"),
                                      ({"loss_scale": -1}, "loss_scale"),
                                      ({"loss_scale": 0, "min_loss_scale": 0}, "min_loss_scale"),
                                      ({"loss_scale": 0, "initial_scale_power": 200},
                                       "initial_scale_power")])
def test_bad_config_names_the_key(cfg, key):
    with pytest.raises(ConfigError, match=key):
        create_loss_scaler(cfg)


def test_state_dict_round_trip_continues_identically():
    flags = [False, True, False, False, True, True, False, False, False, False]
    a = DynamicLossScaler(init_scale=64, scale_window=2, min_scale=1, delayed_shift=2)
    _run(a, flags[:5])
    state = json.loads(json.dumps(a.state_dict()))
    b = DynamicLossScaler(init_scale=64, scale_window=2, min_scale=1, delayed_shift=2)
    b.load_state_dict(state)
    assert _run(a, flags[5:]) == _run(b, flags[5:])
    assert (a.cur_iter, a.last_overflow_iter) == (b.cur_iter, b.last_overflow_iter)


def test_has_overflow():
    finite = [torch.randn(10), None, torch.empty(0), torch.ones(3, dtype=torch.bfloat16)]
    assert not has_overflow(finite)
    assert not has_overflow([])
    assert has_overflow(finite + [torch.tensor([1.0, float("inf")])])
    assert has_overflow([torch.tensor([float("nan"), 1.0], dtype=torch.float16)])
    assert has_overflow([torch.tensor([-float("inf")])])
    # Large finite fp16 values whose 2-norm would overflow fp16 are not an overflow.
    assert not has_overflow([torch.full((1000,), 60000.0, dtype=torch.float16)])

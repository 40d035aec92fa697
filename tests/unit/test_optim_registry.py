"""build_optimizer: DeepSpeed names → torch classes, DeepSpeed defaults, fused kernels, errors."""
import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.optim import OPTIMIZER_NAMES, Lamb, Lion, build_optimizer


def _params(device="cpu"):
    return [torch.nn.Parameter(torch.randn(4, 3, device=device)),
            torch.nn.Parameter(torch.randn(3, device=device))]


def _step(opt):
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    opt.step()


def test_adam_defaults_to_decoupled_weight_decay_with_fused_adams_defaults():
    opt = build_optimizer("Adam", _params(), {})
    assert type(opt) is torch.optim.AdamW
    d = opt.defaults
    # FusedAdam's defaults; torch's AdamW alone would use weight_decay=0.01.
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)


def test_adam_w_mode_false_is_l2_adam_and_json_lists_become_tuples():
    opt = build_optimizer("adam", _params(), {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                              "weight_decay": 0.1, "adam_w_mode": False,
                                              "torch_adam": True, "bias_correction": True})
    assert type(opt) is torch.optim.Adam
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1)


def test_adamw_forces_decoupled_mode_and_amsgrad_passes_through():
    opt = build_optimizer("ADAMW", _params(), {"adam_w_mode": False, "amsgrad": True})
    assert type(opt) is torch.optim.AdamW and opt.defaults["amsgrad"] is True
    _step(opt)


@pytest.mark.parametrize("name, cls", [("SGD", torch.optim.SGD), ("Adagrad", torch.optim.Adagrad),
                                       ("adam", torch.optim.AdamW), ("AdamW", torch.optim.AdamW)])
def test_fused_is_used_on_cpu_where_torch_has_it(name, cls):
    opt = build_optimizer(name, _params(), {"lr": 0.01})
    assert type(opt) is cls
    assert opt.defaults.get("fused") is True
    _step(opt)


def test_fused_false_is_respected_and_foreach_used_instead():
    opt = build_optimizer("AdamW", _params(), {"fused": False})
    assert not opt.defaults.get("fused") and opt.defaults.get("foreach") is True


def test_classes_without_fused_get_foreach_and_accept_fused_key():
    opt = build_optimizer("RMSprop", _params(), {"lr": 0.01, "fused": True})
    assert type(opt) is torch.optim.RMSprop
    assert opt.defaults.get("foreach") is True and "fused" not in opt.defaults
    _step(opt)


def test_meta_parameters_are_safe():
    params = _params("meta")
    opt = build_optimizer("AdamW", params, {})
    assert not opt.defaults.get("fused")
    for p in params:
        p.grad = torch.empty_like(p)
    opt.step()


def test_device_type_without_fused_kernel_disables_fused():
    opt = build_optimizer("Adagrad", _params(), {}, device_type="mps")
    assert not opt.defaults.get("fused")  # Adagrad is fused on CPU and CUDA only
    opt = build_optimizer("AdamW", _params(), {}, device_type="meta")
    assert not opt.defaults.get("fused")


@pytest.mark.parametrize("name, cls", [("Lamb", Lamb), ("lion", Lion)])
def test_shardwise_optimizers(name, cls):
    opt = build_optimizer(name, _params(), {"lr": 0.02, "betas": [0.9, 0.98]})
    assert type(opt) is cls and opt.defaults["betas"] == (0.9, 0.98) and opt.defaults["lr"] == 0.02
    _step(opt)


def test_lion_gets_deepspeed_fusedlion_defaults_from_config():
    d = build_optimizer("Lion", _params(), {}).defaults
    assert (d["lr"], d["betas"], d["weight_decay"]) == (1e-3, (0.9, 0.999), 0.0)


def test_lamb_keeps_deepspeed_specific_keys():
    opt = build_optimizer("LAMB", _params(), {"max_coeff": 5.0, "min_coeff": 0.1,
                                              "bias_correction": False, "eps_inside_sqrt": True})
    assert opt.defaults["max_coeff"] == 5.0 and opt.defaults["bias_correction"] is False


@pytest.mark.parametrize("name, cls", [("RMSprop", torch.optim.RMSprop), ("nadam", torch.optim.NAdam),
                                       ("RAdam", torch.optim.RAdam), ("Adafactor", torch.optim.Adafactor),
                                       ("adamax", torch.optim.Adamax)])
def test_any_torch_optimizer_by_name(name, cls):
    opt = build_optimizer(name, _params(), {"lr": 0.01})
    assert type(opt) is cls and opt.defaults["lr"] == 0.01


def test_param_groups_and_generators_are_accepted():
    a, b = _params()
    opt = build_optimizer("AdamW", [{"params": [a], "weight_decay": 0.0},
                                    {"params": [b], "weight_decay": 0.1}], {"weight_decay": 0.05})
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1]
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer("SGD", model.parameters(), {"lr": 0.1, "momentum": 0.9})
    assert len(opt.param_groups[0]["params"]) == 2


def test_names_list_is_complete():
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion", "RMSprop", "Adafactor"):
        assert name in OPTIMIZER_NAMES


def test_unknown_type_lists_valid_names_and_nearest():
    with pytest.raises(ConfigError) as err:
        build_optimizer("AdamWW", _params(), {})
    msg = str(err.value)
    assert "'AdamWW'" in msg and "Did you mean 'AdamW'" in msg
    assert all(name in msg for name in ("Adam", "Lamb", "Lion", "SGD", "RMSprop"))


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "onebitlamb"])
def test_one_bit_family_is_rejected_with_a_suggestion(name):
    with pytest.raises(ConfigError, match="1-bit.*Adam"):
        build_optimizer(name, _params(), {})


def test_mup_family_is_rejected():
    with pytest.raises(ConfigError, match="mup"):
        build_optimizer("MuAdamW", _params(), {})


def test_unknown_kwarg_names_the_key_and_accepted_parameters():
    with pytest.raises(ConfigError) as err:
        build_optimizer("AdamW", _params(), {"lr": 1e-3, "beta": [0.9, 0.99]})
    msg = str(err.value)
    assert "optimizer.params.beta " in msg and "AdamW" in msg and "betas" in msg and "eps" in msg


def test_empty_params():
    for empty in ([], iter([]), [{"params": []}]):
        with pytest.raises(ConfigError, match="optimizer given without parameters"):
            build_optimizer("Adam", empty, {})


def test_bias_correction_false_for_adam():
    with pytest.raises(ConfigError, match="bias_correction"):
        build_optimizer("Adam", _params(), {"bias_correction": False})


def test_auto_value_and_torch_rejections_become_config_errors():
    with pytest.raises(ConfigError, match="auto"):
        build_optimizer("AdamW", _params(), {"lr": "auto"})
    with pytest.raises(ConfigError, match="AdamW"):
        build_optimizer("AdamW", _params(), {"lr": -1.0})


def test_deepspeed_ops_names_build_torch_optimizers() -> None:
    import shardwise
    from shardwise.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from shardwise.ops.lamb import FusedLamb
    from shardwise.ops.lion import FusedLion
    params = [torch.nn.Parameter(torch.randn(4))]
    assert isinstance(FusedAdam(params, lr=0.1), torch.optim.AdamW)
    assert type(FusedAdam(params, adam_w_mode=False)) is torch.optim.Adam
    cpu = DeepSpeedCPUAdam(params, lr=0.2, weight_decay=0.1)
    assert isinstance(cpu, torch.optim.AdamW) and cpu.defaults["weight_decay"] == 0.1
    assert type(FusedLamb(params)).__name__ == "Lamb"
    assert FusedLion(params).defaults["betas"] == (0.9, 0.999)
    assert shardwise.ops.__name__ == "shardwise.ops"

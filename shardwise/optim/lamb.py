"""LAMB (You et al., 2019) with DeepSpeed FusedLamb's semantics, on torch ``_foreach_*`` ops.

Per parameter tensor: an Adam direction (bias-corrected moments) plus L2 weight decay,
rescaled by the trust ratio ||w|| / ||update|| clamped to [min_coeff, max_coeff]; the
ratio is 1 where either norm is 0. The arithmetic follows DeepSpeed's CUDA kernel
(``csrc/lamb/fused_lamb_cuda_kernel.cu``): ||w|| is taken before the update, weight decay
is added to the direction before its norm, and ``eps_inside_sqrt`` selects
``sqrt(v_hat + eps)`` over ``sqrt(v_hat) + eps``.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Tuple

import torch

from ._state import collect_group

from shardwise.errors import ConfigError

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """LAMB optimizer, DeepSpeed ``FusedLamb``-compatible arguments and defaults.

    The trust ratio is computed **per parameter tensor**: a ZeRO partition must hand
    this optimizer whole parameters (not flat slices spanning several tensors or a
    slice of one), otherwise the norms, and so the update, differ from unpartitioned
    training.

    Args:
        params: tensors or param-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by (1 - beta ** step).
        betas: decay rates of the first and second moment.
        eps: denominator term.
        eps_inside_sqrt: use sqrt(v_hat + eps) instead of sqrt(v_hat) + eps.
        weight_decay: L2 coefficient added to the update direction (so it is scaled by
            the trust ratio, as in the paper).
        max_grad_norm: when > 0, gradients of a group are divided by
            ((||g||_group + 1e-6) / max_grad_norm) if that exceeds 1.
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
        amsgrad: not supported (accepted so DeepSpeed configs with ``false`` load).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise ConfigError("optimizer.params.amsgrad=true is not supported by Lamb (DeepSpeed's "
                              "FusedLamb rejects it too); remove the key or set it to false.")
        _check_hparams(lr, betas, eps, weight_decay, max_coeff, min_coeff, max_grad_norm)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        # Trust ratios of the last step, one 0-dim tensor per stepped parameter, in group
        # order (DeepSpeed exposes them through get_lamb_coeffs()).
        self.lamb_coeffs: List[torch.Tensor] = []

    def get_lamb_coeffs(self) -> List[float]:
        """The trust ratios used by the last ``step()`` (forces a host sync)."""
        return [float(c) for c in self.lamb_coeffs]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One LAMB update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            t = collect_group(self, group, ("exp_avg", "exp_avg_sq"))
            if t["params"]:
                self.lamb_coeffs.extend(_lamb_update(group, t["params"], t["grads"], t["exp_avg"],
                                                     t["exp_avg_sq"], t["step"]))
        return loss


def _lamb_update(group: dict, params: List[torch.Tensor], grads: List[torch.Tensor],
                 exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor],
                 steps: List[torch.Tensor]) -> List[torch.Tensor]:
    """Apply one LAMB step to one group's tensors in place; returns the trust ratios."""
    beta1, beta2 = group["betas"]
    torch._foreach_add_(steps, 1.0)

    if group["max_grad_norm"] > 0:
        # Global (group) norm clip, as FusedLamb's combined_scale, kept on device (no sync).
        norms = torch._foreach_norm(grads, 2.0)
        total = torch.linalg.vector_norm(torch.stack([n.to(params[0].device) for n in norms]))
        clip = ((total + 1e-6) / group["max_grad_norm"]).clamp(min=1.0)
        grads = torch._foreach_div(grads, clip)

    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

    if group["bias_correction"]:
        # Steps live on the CPU (like torch's non-capturable optimizers), so reading them
        # costs no device sync.
        bc1 = [1.0 - beta1 ** float(s) for s in steps]
        bc2 = [1.0 - beta2 ** float(s) for s in steps]
        m_hat = torch._foreach_div(exp_avgs, bc1)
        v_hat = torch._foreach_div(exp_avg_sqs, bc2)
    else:
        m_hat = torch._foreach_mul(exp_avgs, 1.0)
        v_hat = exp_avg_sqs

    if group["eps_inside_sqrt"]:
        denom = torch._foreach_sqrt(torch._foreach_add(v_hat, group["eps"]))
    else:
        denom = torch._foreach_sqrt(v_hat)
        torch._foreach_add_(denom, group["eps"])
    update = m_hat
    torch._foreach_div_(update, denom)
    if group["weight_decay"] != 0:
        torch._foreach_add_(update, params, alpha=group["weight_decay"])

    w_norms = torch._foreach_norm(params, 2.0)
    u_norms = torch._foreach_norm(update, 2.0)
    ratios = [_trust_ratio(w, u, group["min_coeff"], group["max_coeff"])
              for w, u in zip(w_norms, u_norms)]
    # Fold lr into the ratio so a tensor lr (torch allows it) needs no special path.
    torch._foreach_mul_(update, [r * group["lr"] for r in ratios])
    torch._foreach_sub_(params, update)
    return ratios


def _trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, min_coeff: float,
                 max_coeff: float) -> torch.Tensor:
    """||w|| / ||u|| clamped to [min_coeff, max_coeff]; 1 where either norm is 0."""
    ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
    both_nonzero = (w_norm != 0) & (u_norm != 0)
    return torch.where(both_nonzero, ratio, torch.ones_like(ratio))


def _check_hparams(lr, betas, eps, weight_decay, max_coeff, min_coeff, max_grad_norm) -> None:
    fix = "fix optimizer.params in the config"
    if not (isinstance(lr, torch.Tensor) or lr >= 0):
        raise ConfigError(f"optimizer.params.lr must be >= 0, got {lr!r}; {fix}.")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"optimizer.params.betas must be two numbers in [0, 1), got {betas!r}; {fix}.")
    if eps < 0 or weight_decay < 0 or max_grad_norm < 0:
        raise ConfigError(f"optimizer.params eps, weight_decay and max_grad_norm must be >= 0, got "
                          f"eps={eps!r}, weight_decay={weight_decay!r}, "
                          f"max_grad_norm={max_grad_norm!r}; {fix}.")
    if not 0 <= min_coeff <= max_coeff:
        raise ConfigError(f"optimizer.params needs 0 <= min_coeff <= max_coeff, got "
                          f"min_coeff={min_coeff!r}, max_coeff={max_coeff!r}; {fix}.")

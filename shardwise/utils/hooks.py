"""Callbacks that do not keep their owner alive.

Two places hand a bound method of an engine-owned object to something that outlives it:

- ``Tensor.register_post_accumulate_grad_hook`` keeps its hooks on the parameter where the
  cycle collector does not look. A hook that is a bound method of an object which itself
  holds the parameter (a strategy's slot table, its buckets) makes a cycle that
  ``gc.collect()`` never frees.
- Stage 3's partition records call back into the strategy when a ``GatheredParameters`` edit
  changes a parameter; the records live as long as the parameters (the process-wide owner
  table keeps them), so a strong callback keeps the strategy, and through it the parameters.

Either way every engine built in a process would keep its parameters, gradients and
optimizer states until the process ends (an RLHF loop, a hyper-parameter sweep, a notebook).
:func:`weak_method` calls the method through a weak reference instead; once its object is
gone the call does nothing.
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable, List

import torch

ParamCallback = Callable[[torch.Tensor], None]


def weak_method(method: ParamCallback) -> ParamCallback:
    """A callable that calls the bound ``method`` while its object lives, else nothing (a
    plain function is returned as it is: it keeps no owner alive)."""
    if getattr(method, "__self__", None) is None:
        return method
    ref = weakref.WeakMethod(method)

    def call(param: torch.Tensor) -> None:
        fn = ref()
        if fn is not None:
            fn(param)

    call.__qualname__ = f"weak_method({method.__qualname__})"
    return call


def add_grad_hooks(params: Iterable[torch.Tensor], method: ParamCallback) -> List:
    """Register :func:`weak_method` of ``method`` as each parameter's post-accumulate-grad
    hook; returns the handles."""
    hook = weak_method(method)
    return [p.register_post_accumulate_grad_hook(hook) for p in params]


__all__ = ["ParamCallback", "add_grad_hooks", "weak_method"]

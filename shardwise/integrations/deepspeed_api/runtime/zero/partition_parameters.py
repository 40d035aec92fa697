"""``deepspeed.runtime.zero.partition_parameters``: the names transformers patches around
``zero.Init``.

DeepSpeed's ``zero.Init`` wraps torch's tensor constructors to cast their dtype;
transformers' ``prevent_arange_dtype_change()`` swaps ``zero_wrapper_for_fp_tensor_constructor``
to keep ``torch.arange`` out of it. shardwise's ``zero.Init`` never wraps constructors, so the
wrapper here is the identity and the swap has nothing to change.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .....zero import GatheredParameters, Init  # noqa: F401
from ...accelerator import get_accelerator  # noqa: F401

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: Any = None,
                                           *args: Any, **kwargs: Any) -> Callable:
    """Identity: shardwise leaves tensor constructors alone."""
    return fn

"""The accelerator abstraction: which device this process computes on and how to use it.

``get_accelerator()`` picks CUDA (ROCm included), XPU, MPS or CPU, in that order, unless
``SHARDWISE_ACCELERATOR`` (or DeepSpeed's ``DS_ACCELERATOR``) names one.
"""
from .base import Accelerator, get_accelerator, set_accelerator

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]

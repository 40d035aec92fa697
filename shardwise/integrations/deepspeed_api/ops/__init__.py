"""``deepspeed.ops``: DeepSpeed's optimizer class names on torch's kernels (``shardwise.ops``)."""
from . import adagrad, adam, lion  # noqa: F401

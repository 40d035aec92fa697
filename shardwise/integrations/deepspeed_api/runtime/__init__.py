"""``deepspeed.runtime``: the engine class, the LR schedules and ``runtime.zero`` (imported
eagerly, as DeepSpeed does: Accelerate reads ``deepspeed.runtime.lr_schedules`` as an attribute)."""
from . import engine, lr_schedules, zero  # noqa: F401

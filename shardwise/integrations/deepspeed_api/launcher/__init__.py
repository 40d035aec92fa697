"""``deepspeed.launcher``: the constants ``accelerate launch`` reads (``runner``)."""
from . import runner  # noqa: F401

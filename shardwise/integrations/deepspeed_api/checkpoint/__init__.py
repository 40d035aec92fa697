"""``deepspeed.checkpoint``: the helpers Accelerate imports (``utils.clone_tensors_for_torch_save``)."""
from . import utils  # noqa: F401

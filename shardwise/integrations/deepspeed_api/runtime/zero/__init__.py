"""``deepspeed.runtime.zero``: the same names as ``deepspeed.zero`` (``shardwise.zero``)."""
from .....zero import GatheredParameters, Init, register_external_parameter  # noqa: F401
from .....zero import unregister_external_parameter  # noqa: F401

"""``shardwise.OnDevice``: build a model without allocating its weights (DeepSpeed's name).

    with shardwise.OnDevice(dtype=torch.float16, device="meta"):
        model = AutoModelForCausalLM.from_config(config)
    engine = shardwise.init_inference(model, checkpoint="path/to/hf_dir", dtype="fp16")

On ``device="meta"`` every *parameter* registered inside the block lives on the meta device
(no memory); buffers (rotary tables, masks: small, and often not in checkpoints) stay real,
as accelerate's ``init_empty_weights`` does. ``checkpoint=`` then loads each weight straight
onto its device. Any other device (``"cuda:0"``, ``"cpu"``) makes it the default device of
the block, so weights are created there. ``dtype`` is the default float dtype inside.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn


class OnDevice:
    """Context manager: create modules' parameters on ``device`` in ``dtype``."""

    def __init__(self, dtype: Optional[torch.dtype] = None,
                 device: Union[str, torch.device] = "meta", enabled: bool = True) -> None:
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._saved_dtype: Optional[torch.dtype] = None
        self._saved_register: Any = None
        self._device_ctx: Any = None

    def __enter__(self) -> "OnDevice":
        if not self.enabled:
            return self
        if self.dtype is not None and self.dtype.is_floating_point:
            self._saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        if self.device.type == "meta":
            self._saved_register = nn.Module.register_parameter
            original = self._saved_register

            def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
                original(module, name, param)
                if param is not None and not param.is_meta:
                    kwargs = {"requires_grad": param.requires_grad}
                    module._parameters[name] = type(param)(param.to("meta"), **kwargs)

            nn.Module.register_parameter = register_on_meta
        else:
            self._device_ctx = torch.device(self.device)
            self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self._saved_register is not None:
            nn.Module.register_parameter = self._saved_register
            self._saved_register = None
        if self._device_ctx is not None:
            self._device_ctx.__exit__(*exc)
            self._device_ctx = None
        if self._saved_dtype is not None:
            torch.set_default_dtype(self._saved_dtype)
            self._saved_dtype = None

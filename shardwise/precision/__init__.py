"""Mixed-precision support: the fp16 loss scaler with DeepSpeed's dynamic-scale rules."""
from .loss_scaler import (DynamicLossScaler, LossScaleUnderflowError, StaticLossScaler,
                          create_loss_scaler, has_overflow)

__all__ = ["DynamicLossScaler", "StaticLossScaler", "LossScaleUnderflowError",
           "create_loss_scaler", "has_overflow"]

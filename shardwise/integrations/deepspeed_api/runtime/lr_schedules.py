"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedule classes and their name list.

Accelerate tells a DeepSpeed schedule from a torch one by ``type(obj).__name__ in
VALID_LR_SCHEDULES``."""
from ....optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
           "WarmupCosineLR"]

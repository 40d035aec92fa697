"""The batch triple: train_batch_size = micro_batch_per_gpu x gradient_accumulation_steps x world_size.

Filled in from whichever keys are given, the way DeepSpeed does it, with two extensions
DeepSpeed refuses: no key at all gives micro=1, GA=1 (a script that only wants ZeRO need not
think about batches), and GA alone gives micro=1.
"""
from __future__ import annotations

from typing import Optional, Tuple

from shardwise.errors import ConfigError

_FIX = ("Give any two of train_batch_size, train_micro_batch_size_per_gpu and "
        "gradient_accumulation_steps (or all three, consistent), e.g. "
        "\"train_micro_batch_size_per_gpu\": 4, \"gradient_accumulation_steps\": 8.")


def _numbers(train: Optional[int], micro: Optional[int], ga: Optional[int], world: int) -> str:
    return (f"train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
            f"gradient_accumulation_steps={ga}, world_size={world}")


def _check_positive(train: Optional[int], micro: Optional[int], ga: Optional[int], world: int) -> None:
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", ga)):
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value} "
                              f"({_numbers(train, micro, ga, world)}). {_FIX}")


def _hint(train: Optional[int], micro: Optional[int], ga: Optional[int], world: int) -> str:
    if None not in (train, micro, ga):
        return (f"Set train_batch_size to {micro * ga * world} ({micro} x {ga} x {world}), or drop "
                f"one of the three keys and let it be derived.")
    step = (micro or 1) * (ga or 1) * world
    return f"With these keys, train_batch_size must be a positive multiple of {step}. {_FIX}"


def resolve_batch(train: Optional[int], micro: Optional[int], ga: Optional[int],
                  world_size: int) -> Tuple[int, int, int]:
    """Return (train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps), all ints.

    Raises ConfigError naming all four numbers when they cannot satisfy
    train == micro * ga * world_size.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}; pass the "
                          f"data-parallel world size, e.g. load_config(..., world_size=2).")
    given = (train, micro, ga)
    _check_positive(train, micro, ga, world_size)
    if train is not None and micro is not None and ga is None:
        ga = train // (micro * world_size)
    elif train is not None and ga is not None and micro is None:
        micro = train // (ga * world_size)
    elif train is not None and micro is None and ga is None:
        ga, micro = 1, train // world_size
    else:
        # Only micro and/or GA (or nothing): the missing factors default to 1.
        micro = 1 if micro is None else micro
        ga = 1 if ga is None else ga
        train = micro * ga * world_size if train is None else train
    if micro < 1 or ga < 1 or train != micro * ga * world_size:
        raise ConfigError(
            f"Batch sizes are inconsistent: train_batch_size must equal "
            f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size, but "
            f"given {_numbers(*given, world_size)} that gives {micro} x {ga} x "
            f"{world_size} = {micro * ga * world_size} != {train}. {_hint(*given, world_size)}")
    return train, micro, ga

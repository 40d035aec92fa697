"""Run Hugging Face ``transformers.Trainer`` and ``accelerate`` with shardwise as the engine.

Both libraries drive DeepSpeed through ``import deepspeed`` and a handful of its names.
``use_as_deepspeed()`` makes that import resolve to shardwise in this process, so their
own, maintained DeepSpeed code paths ("auto" filling from ``TrainingArguments``,
``zero.Init`` in ``from_pretrained``, checkpoint save/resume) run unchanged on shardwise::

    import shardwise.integrations
    shardwise.integrations.use_as_deepspeed()      # before importing transformers/accelerate

    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(..., deepspeed="ds_config.json")

See docs/integrations.md for what works, why an alias rather than a Trainer subclass, and
the limits.
"""
from __future__ import annotations

from .alias import ALIAS_VERSION, DEEPSPEED_API_VERSION, AliasError, is_installed


def use_as_deepspeed() -> None:
    """Make ``import deepspeed`` (and ``importlib.metadata.version("deepspeed")``) resolve to
    shardwise in this process. Call it at the top of the training script, before importing
    transformers' Trainer/models or accelerate; idempotent. Raises ``AliasError`` when the
    real DeepSpeed is already imported or transformers already decided DeepSpeed is absent."""
    from .alias import install
    install()


def stop_using_as_deepspeed() -> None:
    """Undo :func:`use_as_deepspeed` (drops the ``deepspeed`` modules from ``sys.modules``);
    modules that already imported DeepSpeed names keep them."""
    from .alias import uninstall
    uninstall()


__all__ = ["use_as_deepspeed", "stop_using_as_deepspeed", "is_installed", "AliasError",
           "ALIAS_VERSION", "DEEPSPEED_API_VERSION"]

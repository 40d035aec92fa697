"""Sharded checkpoints: save/load at any world size and ZeRO stage, consolidated export.

- ``engine.save_checkpoint`` / ``engine.load_checkpoint`` / ``engine.save_16bit_model``
  delegate to :mod:`shardwise.checkpoint.engine_io`.
- :func:`get_fp32_state_dict` and :func:`export_safetensors` (``shardwise convert``)
  consolidate a checkpoint into one model.
- :class:`CheckpointReader` reads any slice of any tensor, whatever wrote it.
- :func:`atomic_write_bytes` / :func:`atomic_open`: crash-safe writes (temp name + os.replace).

The format is described in :mod:`shardwise.checkpoint.format` and ``docs/checkpoint.md``.
"""
from __future__ import annotations

from .atomic import atomic_open, atomic_write_bytes, atomic_write_text
from .consolidate import export_safetensors, get_fp32_state_dict
from .engine_io import load_checkpoint, save_16bit_model, save_checkpoint
from .format import validate_tag
from .reshard import CheckpointReader, available_tags

__all__ = ["atomic_open", "atomic_write_bytes", "atomic_write_text", "export_safetensors",
           "get_fp32_state_dict", "load_checkpoint", "save_16bit_model", "save_checkpoint",
           "validate_tag", "CheckpointReader", "available_tags"]

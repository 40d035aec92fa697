"""The base class of every config section, and the dtype-name parsing they share.

Every section is a pydantic v2 model whose field names are DeepSpeed's JSON key names.
Alternative spellings (``stage3_prefetch_bucket_size``, ``bfloat16``) are listed in the
class variable ``aliases`` and renamed by the key walker (``keys.py``) before validation,
so the models themselves only ever see the canonical name and ``to_dict()`` writes one
spelling back.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, Optional

import torch
from pydantic import BaseModel, ConfigDict

from shardwise.errors import ConfigError

#: Canonical short names of the dtypes a config may name, with every spelling we accept.
#: DeepSpeed writes "fp16"/"bf16"/"fp32"; users coming from torch write "float16" etc.
_DTYPE_SPELLINGS: Dict[str, tuple] = {
    "fp32": ("fp32", "float32", "float", "torch.float32", "torch.float", "single"),
    "fp16": ("fp16", "float16", "half", "torch.float16", "torch.half"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
}
_DTYPE_BY_SPELLING = {s: canon for canon, spellings in _DTYPE_SPELLINGS.items() for s in spellings}
TORCH_DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16,
                                        "bf16": torch.bfloat16}
_CANON_BY_TORCH = {v: k for k, v in TORCH_DTYPES.items()}


def canonical_dtype_name(value: Any, key: str) -> Optional[str]:
    """Return "fp32" | "fp16" | "bf16" for any accepted spelling (or a torch.dtype); None stays None.

    ``key`` is the dotted config key, used in the error message.
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value in _CANON_BY_TORCH:
            return _CANON_BY_TORCH[value]
        raise ConfigError(f"{key}: dtype {value} is not supported; use one of "
                          f"{sorted(_DTYPE_SPELLINGS)} (e.g. \"{key.rsplit('.', 1)[-1]}\": \"bf16\").")
    if isinstance(value, str) and value.strip().lower() in _DTYPE_BY_SPELLING:
        return _DTYPE_BY_SPELLING[value.strip().lower()]
    accepted = ", ".join(f'"{s}"' for spellings in _DTYPE_SPELLINGS.values() for s in spellings)
    raise ConfigError(f"{key}: {value!r} is not a dtype name. Expected one of {accepted} "
                      f"(e.g. \"{key.rsplit('.', 1)[-1]}\": \"bf16\").")


def torch_dtype_of(name: Optional[str]) -> Optional[torch.dtype]:
    """Map a canonical dtype name ("fp32"/"fp16"/"bf16") to the torch dtype; None stays None."""
    return None if name is None else TORCH_DTYPES[name]


class ConfigModel(BaseModel):
    """Base of all sections: unknown keys were already reported by the walker, so ignore them here.

    ``aliases`` maps an alternative JSON spelling to the canonical field name. ``inert``
    names fields we accept for compatibility but do not act on; the walker warns when a
    user sets one of them to something other than its default. ``deepspeed_only`` names
    DeepSpeed keys without a field here (dropped with a note).
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True, use_attribute_docstrings=True,
                              arbitrary_types_allowed=True, validate_assignment=False)

    aliases: ClassVar[Dict[str, str]] = {}
    inert: ClassVar[Dict[str, str]] = {}
    deepspeed_only: ClassVar[Dict[str, str]] = {}
    """DeepSpeed keys of this section that shardwise has no field for, with the reason: the
    walker drops them with one note (never an unknown key, never a typo error)."""

    @classmethod
    def rewrite_raw(cls, raw: Any, path: str, notes: list) -> Any:
        """Hook: turn a legacy raw value (e.g. ``"zero_optimization": true``) into a dict.

        Returns the value to validate; ``notes`` collects warning texts.
        """
        return raw


def lowered(value: Any) -> Any:
    """Validator helper: enum-like strings are matched case- and space-insensitively."""
    return value.strip().lower() if isinstance(value, str) else value

"""``fp8``: train the decoder's linear layers with FP8 matmuls (ours; DeepSpeed leaves FP8 to
Transformer Engine). shardwise/precision/fp8.py applies it at ``initialize()``.

    "fp8": {"enabled": true, "recipe": "tensorwise", "skip_modules": ["mlp.down_proj"]}
"""
from __future__ import annotations

from typing import Any, List, Literal

from pydantic import Field, field_validator

from shardwise.errors import ConfigError

from .base import ConfigModel

#: torchao's Float8LinearConfig recipe names (torchao.float8.config.Float8LinearRecipeName).
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class FP8Config(ConfigModel):
    """``fp8``: swap ``nn.Linear`` layers for torchao's Float8Linear (dynamic scaling)."""

    enabled: bool = False
    """Swap the model's ``nn.Linear`` layers for FP8 matmuls (torchao.float8) at
    ``initialize()``. Needs torchao (``pip install torchao``) and a CUDA GPU with compute
    capability >= 8.9 (Ada, Hopper and newer); an error at ``initialize()`` otherwise."""
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao's scaling recipe: "tensorwise" (one dynamic scale per tensor, fastest),
    "rowwise" (one scale per row, more accurate) or "rowwise_with_gw_hp" (rowwise, weight
    gradient in high precision)."""
    skip_modules: List[str] = Field(default_factory=list)
    """Linear layers to keep in bf16, besides the output head (always kept): each entry is a
    full module name ("model.layers.0.mlp.down_proj"), a glob over full names
    ("model.layers.0.*") or a last name component ("down_proj"). Layers whose in/out features
    are not multiples of 16 are kept too (FP8 matmuls need them)."""

    @field_validator("recipe", mode="before")
    @classmethod
    def _recipe_name(cls, value: Any) -> Any:
        if not isinstance(value, str) or value.strip().lower() not in FP8_RECIPES:
            raise ConfigError(f"fp8.recipe = {value!r} is not a recipe; use one of "
                              f"{', '.join(repr(r) for r in FP8_RECIPES)} (e.g. \"recipe\": "
                              f"\"tensorwise\")")
        return value.strip().lower()

    @field_validator("skip_modules", mode="before")
    @classmethod
    def _module_names(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"fp8.skip_modules = {value!r} ({type(value).__name__}) must be a "
                              f"list of module names, e.g. [\"lm_head\", \"down_proj\"]")
        bad = [v for v in value if not isinstance(v, str) or not v.strip()]
        if bad:
            raise ConfigError(f"fp8.skip_modules: entries must be non-empty module names "
                              f"(strings), got {bad!r}")
        return [v.strip() for v in value]

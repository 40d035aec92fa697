"""docs/config.md tells the truth: every section table lists exactly the keys of its model,
with the model's defaults; the NVMe and no-effect claims match what the code does."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

import shardwise
from shardwise.config import IGNORED_SECTIONS, ShardwiseConfig, load_config
from shardwise.config.keys import nested_model
from shardwise.errors import ConfigError
from tests.distributed._parity import make_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _sections() -> Dict[str, List[Tuple[str, str]]]:
    """heading -> [(key cell, default cell)] of the table under each "### `...`" heading."""
    out: Dict[str, List[Tuple[str, str]]] = {}
    current = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        head = re.match(r"^### `([^`]+)`", line)
        if head:
            current = head.group(1).split(" ")[0]
            out[current] = []
        elif line.startswith("## "):
            current = None
        elif current and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[current].append((cells[0], cells[1]))
    return out


def _model_for(heading: str):
    if heading == "top":
        return ShardwiseConfig
    model = ShardwiseConfig
    for part in heading.split("."):
        model = nested_model(model.model_fields[part].annotation)
    return model


def _expected_default(info) -> str:
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default
    if isinstance(value, torch.dtype):
        return json.dumps({torch.bfloat16: "bf16", torch.float16: "fp16"}[value])
    if value == sys.maxsize and isinstance(value, int) and not isinstance(value, bool):
        return "sys.maxsize"
    return json.dumps(value)


def test_every_section_table_lists_the_models_keys_and_defaults():
    sections = _sections()
    assert len(sections) >= 14
    for heading, rows in sections.items():
        model = _model_for(heading)
        documented = {}
        for key_cell, default_cell in rows:
            names = re.findall(r"`([^`]+)`", key_cell)
            documented[names[0]] = default_cell.strip("`")
            for alias in names[1:]:  # "(also `stage3_...`)"
                assert model.aliases.get(alias) == names[0], (heading, alias)
        fields = {name: info for name, info in model.model_fields.items()
                  if nested_model(info.annotation) is None and name not in IGNORED_SECTIONS}
        nested = {name for name, info in model.model_fields.items()
                  if nested_model(info.annotation) is not None}
        assert set(fields) <= set(documented) <= set(fields) | nested, \
            (heading, set(documented) ^ set(fields))
        for name, info in fields.items():  # a nested section's own table holds its defaults
            assert documented[name] == _expected_default(info), (heading, name)


def test_every_ignored_section_and_inert_key_is_documented():
    text = DOC.read_text(encoding="utf-8")
    for name in IGNORED_SECTIONS:
        assert f"| `{name}` |" in text, name
    for heading in _sections():
        model = _model_for(heading)
        for key in model.inert:
            dotted = key if heading in ("top", "zero_optimization") else f"{heading}.{key}"
            assert f"| `{dotted}` |" in text, dotted
        for key in model.deepspeed_only:
            dotted = key if heading == "top" else f"{heading}.{key}"
            assert f"| `{dotted}` |" in text, dotted


@pytest.mark.parametrize("raw, key", [
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"dump_state": True}, "dump_state"),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage"),
    ({"zero_optimization": {"stage": 2, "ignore_unused_parameters": False}},
     "zero_optimization.ignore_unused_parameters"),
    ({"zero_optimization": {"stage": 3, "use_all_reduce_for_fetch_params": True}},
     "zero_optimization.use_all_reduce_for_fetch_params"),
])
def test_documented_no_effect_keys_say_so_when_set(raw, key):
    cfg = load_config(raw)
    assert any(f"'{key}'" in w and "no effect" in w for w in cfg.warnings), cfg.warnings

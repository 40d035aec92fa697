"""What a checkpoint records about an engine besides its shards: tied names, buffers, RNG
states, counters, config and the optimizer/scaler handles, read through the typed engine
contract (``contract.CheckpointableEngine``).
"""
from __future__ import annotations

import json
import random
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from .contract import CheckpointableEngine
from .format import to_jsonable


def _aliases(module: torch.nn.Module) -> Dict[str, List[str]]:
    """Tied parameters: first name -> the other names of the same tensor."""
    first: Dict[int, str] = {}
    out: Dict[str, List[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
    return out


def _persistent_buffers(module: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    out = []
    for mod_name, mod in module.named_modules():
        for buf_name, buf in mod._buffers.items():
            if buf is None or buf_name in mod._non_persistent_buffers_set:
                continue
            out.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, buf))
    return out


def _inner_optimizer(engine: CheckpointableEngine) -> Optional[torch.optim.Optimizer]:
    return engine.optimizer.inner if engine.optimizer is not None else None


def _loss_scaler(engine: CheckpointableEngine) -> Any:
    scaler = engine.optimizer.loss_scaler if engine.optimizer is not None else None
    return scaler if scaler is not None else engine.loss_scaler


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"python": random.getstate(),
                             "torch": bytes(torch.get_rng_state().numpy())}
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    python = state.get("python")
    if python is not None:
        version, internal, gauss = python
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "numpy" in state:
        try:
            import numpy as np
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
    if "cuda" in state and torch.cuda.is_available():
        states = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def _config_dict(engine: CheckpointableEngine) -> Any:
    raw = engine.checkpoint_settings().config
    try:
        return to_jsonable(raw, "config")
    except CheckpointError:
        return {k: str(v) for k, v in raw.items()}


def _stage(engine: CheckpointableEngine) -> int:
    return int(engine.zero_optimization_stage())


def _grad_accum(engine: CheckpointableEngine) -> Optional[int]:
    return int(engine.gradient_accumulation_steps())


def _hf_config(module: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """A Hugging Face model's config, so ``shardwise convert`` can write ``config.json``."""
    conf = getattr(module, "config", None)
    if conf is None or not hasattr(conf, "to_json_string"):
        return None
    try:
        return json.loads(conf.to_json_string())
    except (TypeError, ValueError):
        return None

"""``checkpoint=``: stream weights from disk into a (possibly meta) module, tensor by tensor.

Three sources, detected from the directory's contents:

* a Hugging Face model directory or a consolidated shardwise export (``shardwise convert``):
  ``model.safetensors`` or ``model.safetensors.index.json`` + shards (``pytorch_model.bin``
  too). Each tensor is read with ``safe_open`` onto its target device and placed alone;
* a shardwise training checkpoint directory (any ZeRO stage, any world size): each
  parameter is assembled from its slices by ``CheckpointReader`` and placed alone;
* a DeepSpeed-style JSON descriptor (dict or path) ``{"checkpoints": [files...],
  "type": ...}`` whose files are safetensors or torch files, relative to ``base_dir``.

No full state dict is held in host memory. Names follow the module's ``state_dict``; a
prefix difference (``model.`` vs bare) is matched. Tied weights are re-tied after loading.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from shardwise.errors import CheckpointError

TensorSource = Iterator[Tuple[str, Callable[[], torch.Tensor]]]


def _safetensor_files(root: Path) -> List[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [root / f for f in dict.fromkeys(weight_map.values())]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(root.glob("*.safetensors"))


def _from_safetensors(files: List[Path], device: torch.device) -> TensorSource:
    from safetensors import safe_open
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in f.keys():
                yield key, (lambda k=key, h=f: h.get_tensor(k))


def _from_torch_files(files: List[Path]) -> TensorSource:
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        for key in list(state):
            yield key, (lambda k=key, s=state: s[k])


def _from_training_checkpoint(root: Path, dtype: Optional[torch.dtype]) -> TensorSource:
    from shardwise.checkpoint.consolidate import _export_names, _tensor
    from shardwise.checkpoint.reshard import CheckpointReader
    with CheckpointReader(root, None) as reader:
        for name in _export_names(reader, False):
            yield name, (lambda n=name: _tensor(reader, n, dtype))


def _descriptor_files(desc: Dict[str, Any], base_dir: str) -> List[Path]:
    files = desc.get("checkpoints")
    if not files:
        raise CheckpointError(f"checkpoint descriptor {desc!r} has no \"checkpoints\" list of files.")
    files = files if isinstance(files, list) else [files]
    return [Path(base_dir) / f for f in files]


def open_source(checkpoint: Union[str, Dict[str, Any]], base_dir: str, device: torch.device,
                dtype: Optional[torch.dtype]) -> TensorSource:
    """The (name, loader) pairs of ``checkpoint`` (see the module docstring)."""
    if isinstance(checkpoint, dict):
        files = _descriptor_files(checkpoint, base_dir)
    else:
        root = Path(base_dir) / checkpoint if base_dir else Path(checkpoint)
        if root.is_file() and root.suffix == ".json":
            return open_source(json.loads(root.read_text(encoding="utf-8")),
                               base_dir or str(root.parent), device, dtype)
        if not root.exists():
            raise CheckpointError(f"checkpoint = {str(checkpoint)!r}: {root.resolve()} does not "
                                  f"exist. Pass a Hugging Face model directory, a shardwise "
                                  f"export or a shardwise training checkpoint directory.")
        from shardwise.checkpoint.reshard import available_tags
        if root.is_dir() and (available_tags(root) or (root / "latest").is_file()):
            return _from_training_checkpoint(root, dtype)
        files = _safetensor_files(root) if root.is_dir() else [root]
        if not files and root.is_dir():
            files = sorted(root.glob("pytorch_model*.bin"))
        if not files:
            raise CheckpointError(f"checkpoint = {str(checkpoint)!r}: no *.safetensors, "
                                  f"pytorch_model*.bin or shardwise checkpoint tag in {root.resolve()}.")
    if all(f.suffix == ".safetensors" for f in files):
        return _from_safetensors(files, device)
    return _from_torch_files(files)


def _match(name: str, targets: Dict[str, Any]) -> Optional[str]:
    if name in targets:
        return name
    for prefix in ("model.", "module.", "_orig_mod."):
        if name.startswith(prefix) and name[len(prefix):] in targets:
            return name[len(prefix):]
        if prefix + name in targets:
            return prefix + name
    return None


def _place(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    current = getattr(owner, leaf)
    if current.is_meta or current.shape != value.shape or current.device != value.device:
        if current.shape != value.shape:
            raise CheckpointError(f"checkpoint tensor '{name}' has shape {tuple(value.shape)}, the "
                                  f"model expects {tuple(current.shape)}: wrong checkpoint for this model?")
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[leaf] = value
    else:
        with torch.no_grad():
            current.copy_(value)


@torch.no_grad()
def load_into(module: nn.Module, checkpoint: Union[str, Dict[str, Any]], base_dir: str,
              device: torch.device, dtype: Optional[torch.dtype]) -> List[str]:
    """Load ``checkpoint`` into ``module`` on ``device`` in ``dtype``; returns missing names."""
    targets = dict(module.named_parameters(remove_duplicate=False))
    targets.update(dict(module.named_buffers(remove_duplicate=False)))
    seen = set()
    for name, load in open_source(checkpoint, base_dir, device, dtype):
        key = _match(name, targets)
        if key is None:
            continue
        value = load()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        _place(module, key, value.to(device))
        seen.add(key)
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    still_meta = [n for n, p in module.named_parameters() if p.is_meta]
    if still_meta:
        raise CheckpointError(f"checkpoint {checkpoint!r} does not hold {len(still_meta)} tensors "
                              f"the model needs (e.g. {still_meta[:3]}); wrong checkpoint?")
    return sorted(set(targets) - seen)

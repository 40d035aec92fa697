"""Turn a sharded checkpoint into one plain model: DeepSpeed's ``zero_to_fp32``.

:func:`get_fp32_state_dict` returns the whole fp32 state dict in memory (for small models
and notebooks). :func:`export_safetensors` writes it as Hugging Face sharded safetensors
(``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``) one tensor at a
time, so its peak memory is about the largest single tensor, not the model: the shard plan
is made from the metadata alone and each tensor is assembled from its slices only when the
writer reaches it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..errors import CheckpointError
from .atomic import atomic_write_bytes
from .export_folder import staged_export
from .format import TensorItem, str_to_dtype, write_safetensors
from .reshard import CheckpointReader

PathLike = Union[str, "Path"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(value: Union[int, str]) -> int:
    """``"5GB"`` → 5·10⁹ bytes, ``"500MiB"`` → 500·2²⁰ (Hugging Face's convention), ints as is."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise CheckpointError(f"--max_shard_size {value!r} is not a size; use e.g. 5GB, 500MB, "
                              "2GiB or a number of bytes.")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise CheckpointError(f"--max_shard_size {value!r} must be positive.")
    return size


def _export_names(reader: CheckpointReader, exclude_frozen: bool) -> List[str]:
    names = [n for n, info in reader.params.items()
             if not (exclude_frozen and not info.get("requires_grad", True))]
    return names + list(reader.meta.get("buffers", {}))


def _tensor(reader: CheckpointReader, name: str, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A parameter in fp32 (from its master) or a buffer in its own dtype, cast to ``dtype``
    for floating tensors."""
    if name in reader.params:
        value = reader.read_fp32(name)
    else:
        value = reader.read_whole("buffer", name)
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    return value


def get_fp32_state_dict(checkpoint_dir: PathLike, tag: Optional[str] = None,
                        exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
    """The consolidated fp32 state dict of a checkpoint, as ``module.load_state_dict`` wants it.

    Trainable parameters come from the fp32 masters; frozen ones from their saved weights;
    buffers keep their dtype. Tied parameters appear under each of their names (sharing one
    tensor). Reads any world size and ZeRO stage.
    """
    with CheckpointReader(checkpoint_dir, tag) as reader:
        state: Dict[str, torch.Tensor] = {}
        for name in _export_names(reader, exclude_frozen_parameters):
            value = _tensor(reader, name, None)
            state[name] = value.float() if name in reader.params else value
        for first, others in reader.meta.get("aliases", {}).items():
            for other in others:
                if first in state:
                    state[other] = state[first]
    return state


def _plan_shards(reader: CheckpointReader, names: List[str], dtype: Optional[torch.dtype],
                 max_bytes: int) -> List[List[Tuple[str, torch.dtype, List[int]]]]:
    """Greedy in-order packing into shards of at most ``max_bytes`` (a larger tensor gets its
    own shard, as Hugging Face does)."""
    shards: List[List[Tuple[str, torch.dtype, List[int]]]] = [[]]
    used = 0
    for name in names:
        if name in reader.params:
            shape, own = reader.params[name]["shape"], torch.float32
        else:
            info = reader.meta["buffers"][name]
            shape, own = info["shape"], str_to_dtype(info["dtype"])
        out = dtype if (dtype is not None and own.is_floating_point) else own
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=out).element_size()
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, out, list(shape)))
        used += nbytes
    return shards


def export_safetensors(checkpoint_dir: PathLike, output_dir: PathLike, tag: Optional[str] = None,
                       max_shard_size: Union[int, str] = "5GB", dtype: torch.dtype = torch.float32,
                       exclude_frozen_parameters: bool = False, write_config: bool = True,
                       overwrite: bool = False) -> List[Path]:
    """Write the consolidated model as Hugging Face safetensors shards; returns the files.

    One shard → ``model.safetensors``; several → ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json`` (``metadata.total_size`` + ``weight_map``). Tied
    duplicates are not written (safetensors stores no aliases; ``from_pretrained`` re-ties
    them). When the checkpoint recorded a Hugging Face config, ``config.json`` is written
    too, so ``from_pretrained(output_dir)`` works directly.

    The files are written into a fresh staging folder that replaces ``output_dir`` only when
    complete (see :mod:`.export_folder`): a folder that already holds an export is refused
    unless ``overwrite=True``, and then that export is replaced as a whole, never mixed with.
    """
    max_bytes = parse_size(max_shard_size)
    with CheckpointReader(checkpoint_dir, tag) as reader, \
            staged_export(Path(output_dir), overwrite) as stage:
        names = _write_shards(reader, stage, _export_names(reader, exclude_frozen_parameters),
                              dtype, max_bytes)
        hf_config = reader.meta.get("hf_config")
        if write_config and hf_config:
            if dtype is not None:  # transformers 5 calls the key "dtype", 4.x "torch_dtype"
                key = "dtype" if "dtype" in hf_config else "torch_dtype"
                hf_config = {**hf_config, key: str(dtype).replace("torch.", "")}
            atomic_write_bytes(stage / "config.json",
                               json.dumps(hf_config, indent=2).encode("utf-8"))
            names.append("config.json")
    return [Path(output_dir) / name for name in names]


def _write_shards(reader: CheckpointReader, out: Path, names: List[str],
                  dtype: Optional[torch.dtype], max_bytes: int) -> List[str]:
    """The shard files (+ index when more than one) into ``out``; returns the file names."""
    shards = _plan_shards(reader, names, dtype, max_bytes)
    total = len(shards)
    weight_map: Dict[str, str] = {}
    total_size = 0
    written: List[str] = []
    for i, shard in enumerate(shards):
        fname = ("model.safetensors" if total == 1
                 else f"model-{i + 1:05d}-of-{total:05d}.safetensors")
        items = [TensorItem(name, dt, shape,
                            (lambda n=name, d=dt: _tensor(reader, n, d).contiguous()))
                 for name, dt, shape in shard]
        write_safetensors(out / fname, items, metadata={"format": "pt"})
        written.append(fname)
        for item in items:
            weight_map[item.key] = fname
            total_size += item.nbytes
    if total > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        atomic_write_bytes(out / "model.safetensors.index.json",
                           json.dumps(index, indent=2).encode("utf-8"))
        written.append("model.safetensors.index.json")
    return written


def describe(checkpoint_dir: PathLike, tag: Optional[str] = None) -> Dict[str, Any]:
    """Small summary of a checkpoint (tag, world size, stage, counters, parameter count)."""
    with CheckpointReader(checkpoint_dir, tag) as reader:
        numel = sum(torch.Size(i["shape"]).numel() for i in reader.params.values())
        return {"tag": reader.tag, "world_size": reader.world_size,
                "zero_stage": reader.meta.get("zero_stage"), "counters": reader.meta.get("counters"),
                "parameters": len(reader.params), "numel": numel}

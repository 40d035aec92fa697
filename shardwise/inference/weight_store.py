"""Where a streamed decoder layer's weights live between uses: one flat host buffer per layer.

A layer's weights are the *storages* its modules' parameters and buffers point into (after
the fast path fuses q/k/v, the fused tensor's storage; the module's own weights are views of
it). ``pack_layer`` lays those storages out back to back in one byte image (64-byte aligned)
and remembers, for every tensor that refers to them (``TensorRef``), its shape, strides and
offset, so the same tensors can later be re-pointed at any copy of the image (``bind``).

Sources of the image's bytes:

* ``HostSource``: a pinned, page-aligned host buffer holding the raw image (bf16/fp16/...), or
  the group-quantized image (``quant_stream``: int8 / int4 codes + fp16 scales);
* ``NvmeSource``: the same bytes in a swap file under ``offload_param.nvme_path``, read into a
  pinned staging buffer by ``shardwise.io``'s ``AsyncIOHandle`` before the device copy.
  DeepSpeed sends only partitions of at least 1 MiB to NVMe (``MIN_NVME_BYTES``); a smaller
  layer stays in host memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Tuple, Union

import torch
from torch import nn

from shardwise.io.aligned import alloc_aligned
from shardwise.io.swap_files import MIN_NVME_BYTES  # noqa: F401  (re-exported)

from .quant_stream import QuantSpec, dequantize_into, quantize_flat

_ALIGN = 64


def storage_key(t: torch.Tensor) -> Tuple[str, int]:
    """Identity of the memory a tensor points into (device type, base address; for a meta
    tensor, which has no address, its storage object)."""
    if t.is_meta:
        return ("meta", t.untyped_storage()._cdata)
    return (t.device.type, t.untyped_storage().data_ptr())


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of ``t``'s storage as a flat uint8 tensor sharing that memory."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))


@dataclass
class TensorRef:
    """One parameter/buffer slot of a module and how its tensor sits in its storage."""

    module: nn.Module
    name: str
    is_param: bool
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, module: nn.Module, name: str, is_param: bool, t: torch.Tensor) -> "TensorRef":
        return cls(module, name, is_param, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                   t.dtype)

    def current(self) -> torch.Tensor:
        table = self.module._parameters if self.is_param else self.module._buffers
        return table[self.name]

    def set(self, value: torch.Tensor, memo: Optional[Dict[int, nn.Parameter]] = None) -> None:
        """Point the slot at ``value`` (a Parameter keeps its identity: ties survive). A meta
        Parameter cannot take real data: it is replaced once, through ``memo`` (old id -> new
        Parameter), so every module that shared it shares the replacement."""
        table = self.module._parameters if self.is_param else self.module._buffers
        obj = table[self.name]
        if isinstance(obj, nn.Parameter) and obj.is_meta and not value.is_meta:
            memo = {} if memo is None else memo
            if id(obj) not in memo:
                memo[id(obj)] = nn.Parameter(value, requires_grad=False)
            table[self.name] = memo[id(obj)]
        elif isinstance(obj, nn.Parameter):
            obj.data = value
        else:
            table[self.name] = value


@dataclass
class Region:
    """One storage inside a layer image."""

    dtype: torch.dtype
    numel: int
    offset: int
    """Byte offset in the image."""
    refs: List[TensorRef] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def views(self, image: torch.Tensor) -> List[torch.Tensor]:
        """Every ref's tensor as a view of ``image`` (a flat uint8 tensor)."""
        typed = image[self.offset:self.offset + self.nbytes].view(self.dtype)
        base = typed.storage_offset()
        return [typed.as_strided(r.shape, r.stride, base + r.offset) for r in self.refs]


def layout(storages: List[Tuple[torch.dtype, int]], quant: Optional[QuantSpec]) -> Tuple[List[int], int]:
    """Byte offsets of (dtype, numel) storages in an image, and the image's size.

    Quantized images pad every storage to a whole number of groups (groups never straddle
    two tensors)."""
    offsets, pos, end = [], 0, _ALIGN  # a layer may stream nothing (all under the threshold)
    for dtype, numel in storages:
        size = torch.empty((), dtype=dtype).element_size()
        pos += -pos % _ALIGN
        if quant is not None:
            unit = quant.group_size * size
            pos += -pos % unit
            end = max(_ALIGN, unit)
        offsets.append(pos)
        pos += numel * size
    pos += -pos % end
    return offsets, max(pos, _ALIGN)


@dataclass
class HostSource:
    """The layer's transfer bytes in one (pinned) host buffer."""

    buffer: torch.Tensor


@dataclass
class NvmeSource:
    """The layer's transfer bytes in a swap file (``nbytes`` long, read from offset 0)."""

    path: str
    nbytes: int


Source = Union[HostSource, NvmeSource]


@dataclass
class LayerImage:
    """One decoder layer's streamed weights: regions, image size, transfer bytes and source."""

    index: int
    regions: List[Region]
    image_bytes: int
    dtype: torch.dtype
    quant: Optional[QuantSpec] = None
    source: Optional[Source] = None
    world: int = 1
    """Ranks the transfer bytes are split over (each holds one shard; all-gathered on fetch)."""

    @property
    def shard_bytes(self) -> int:
        """Bytes one rank holds and copies per fetch (all of them at world size 1)."""
        per = -(-self.transfer_bytes // self.world)
        return per + (-per % _ALIGN) if self.world > 1 else per

    @property
    def transfer_bytes(self) -> int:
        """Bytes crossing the host-device link per fetch (packed when quantized)."""
        if self.quant is None:
            return self.image_bytes
        return self.quant.packed_bytes(self.image_bytes // _elsize(self.dtype))

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self.regions)

    def fill(self, out: torch.Tensor, tensors: Dict[int, torch.Tensor]) -> None:
        """Write the transfer bytes into the host uint8 ``out`` from region index -> tensor
        (quantizing on the GPU when one is present: a 7B layer takes seconds on a CPU)."""
        if self.quant is None:
            for i, region in enumerate(self.regions):
                out[region.offset:region.offset + region.nbytes].copy_(storage_bytes(tensors[i]))
            return
        work = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        image = torch.zeros(self.image_bytes, dtype=torch.uint8, device=work)
        for i, region in enumerate(self.regions):  # quantized on the GPU when there is one
            image[region.offset:region.offset + region.nbytes].copy_(storage_bytes(tensors[i]))
        packed = torch.empty(out.numel(), dtype=torch.uint8, device=work)
        quantize_flat(image.view(self.dtype), self.quant, packed)
        out.copy_(packed)

    def expand(self, staged: torch.Tensor, image: torch.Tensor) -> None:
        """Device side: the copied transfer bytes ``staged`` into the image (dequantize)."""
        dequantize_into(staged, self.quant, image[:self.image_bytes].view(self.dtype))

    def bind(self, image: torch.Tensor, memo: Optional[Dict[int, nn.Parameter]] = None) -> None:
        """Point every ref of this layer at its view of ``image``."""
        for region in self.regions:
            for ref, view in zip(region.refs, region.views(image)):
                ref.set(view, memo)


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A page-aligned host byte buffer, pinned when asked and the accelerator can."""
    return alloc_aligned(nbytes + (-nbytes % 4096), pin=pin)[:nbytes]


class CheckpointTensors:
    """Random access by name to the tensors of a Hugging Face safetensors directory, so a meta
    model's layers are read one at a time (never the whole model in host memory)."""

    def __init__(self, files: List[str]) -> None:
        from safetensors import safe_open
        self._handles = [safe_open(f, framework="pt", device="cpu") for f in files]
        self._where = {key: h for h in self._handles for key in h.keys()}

    def find(self, name: str) -> Optional[str]:
        """The checkpoint's key for module tensor ``name`` (``model.`` prefixes matched)."""
        from .loading import _match
        return _match(name, self._where) if self._where else None

    def get(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def materialize(self, region: "Region", names: Dict[int, str]) -> torch.Tensor:
        """A CPU tensor holding ``region``'s storage, every named ref's view filled from the
        checkpoint (``names``: id(ref) -> module tensor name)."""
        out = torch.zeros(region.numel, dtype=region.dtype)
        filled = False
        for ref in region.refs:
            key = self.find(names.get(id(ref), ""))
            if key is None:
                continue
            out.as_strided(ref.shape, ref.stride, ref.offset).copy_(self.get(key))
            filled = True
        if not filled:
            from shardwise.errors import CheckpointError
            wanted = sorted(names.get(id(r), "?") for r in region.refs)
            raise CheckpointError(f"the checkpoint holds none of {wanted}: wrong checkpoint for "
                                  f"this model?")
        return out


class LayerWeights(Protocol):
    """Where a meta model's weights come from, one storage at a time (``CheckpointTensors``,
    ``RandomWeights``): ``LayerStreamer`` asks for a layer's storages, packs them into its
    host buffer or swap file and drops them before the next layer."""

    def materialize(self, region: "Region", names: Dict[int, str]) -> torch.Tensor:
        """A tensor (any device) holding ``region``'s whole storage."""


class RandomWeights:
    """Random weights for a meta model, made storage by storage on ``device`` (the GPU when
    there is one: ``normal_`` there takes milliseconds per layer where a CPU takes seconds):
    ``N(0, std)`` for matrices, 1 for 1-D weights (norms), 0 for biases. For benchmarks of
    shapes that do not fit anywhere whole (a 70B Llama in 4 bits); pass it to
    ``InferenceEngine(model, config, layer_weights=RandomWeights())``."""

    def __init__(self, std: float = 0.02, seed: int = 0,
                 device: Optional[Union[str, torch.device]] = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device, self.std = torch.device(device), float(std)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def materialize(self, region: "Region", names: Dict[int, str]) -> torch.Tensor:
        out = torch.empty(region.numel, dtype=region.dtype, device=self.device)
        if region.dtype.is_floating_point:
            out.normal_(0.0, self.std, generator=self.generator)
        else:
            out.zero_()
        for ref in region.refs:
            if len(ref.shape) == 1:  # norms' weights 1, biases 0
                view = out.as_strided(ref.shape, ref.stride, ref.offset)
                view.fill_(0 if ref.name == "bias" else 1)
        return out

"""``LayerStreamer``: decoder layers' weights streamed to the device one copy per layer, with a
prefetch window, while the previous layer computes.

Setup (``LayerStreamer(model, decoder, device, settings)``):

1. every parameter/buffer of the model (and of the fast path's blocks, which share the
   layers' norms and hold the fused projections) is grouped by the storage it points into;
2. a storage used by exactly one decoder layer and larger than
   ``stage3_param_persistence_threshold`` elements is *streamed*: it goes into that layer's
   flat host image (``weight_store``), pinned host memory or an NVMe swap file, raw or
   group-quantized; everything else (embeddings, LM head, final norm, small norms/biases)
   is *resident*: moved to the device once;
3. each layer gets a forward pre-hook and a forward hook (the Hugging Face layer and the
   fast path's block for the same index: whichever runs).

Per forward pass: the pre-hook of layer ``i`` waits for layer ``i``'s copy (an event on the
copy stream), points the layer's tensors at their views of the device slot, and issues the
copies of layers ``i+1 .. i+k`` (wrapping to the next pass's first layers) on a side stream;
each copy waits for the compute of the layer whose slot it reuses. ``k + 1`` device slots
exist; a layer still in its slot is not copied again (so a model that fits in the window is
copied once). From NVMe, the next layer's swap file is read into a pinned staging buffer by
``shardwise.io``'s ``AsyncIOHandle`` one stage before its device copy.

At world size > 1 each rank keeps 1/world of every layer's transfer bytes (host or NVMe),
copies its shard up and the ranks all-gather the layer into the slot (gloo or NCCL) before it
is expanded/bound; every rank must then run the same forward passes, as with DeepSpeed's
ZeRO-3 (``synced_gpus``).

On a CPU-only machine the same code runs with the device = CPU (copies are plain memcpy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from shardwise.accelerator import get_accelerator
from shardwise.errors import ConfigError

from .quant_stream import QuantSpec
from .weight_store import (MIN_NVME_BYTES, HostSource, LayerImage, LayerWeights, NvmeSource, Region,
                           TensorRef, host_buffer, layout, storage_bytes, storage_key)

_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers",
                "transformer.layers", "model.transformer.h")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers (known layouts first, else the largest ModuleList)."""
    for path in _LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList) and len(obj):
            return obj
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        raise ConfigError(f"ZeRO-Inference streams decoder layers, but {type(model).__name__} "
                          f"has no nn.ModuleList of layers. Drop zero.offload_param for this model.")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


@dataclass(frozen=True)
class StreamSettings:
    """What the config decided for streaming (see ``zero_inference.settings_from``)."""

    persistence_threshold: int
    """Storages with at most this many elements stay resident on the device."""
    max_live_parameters: int
    """Streamed elements allowed on the device at once (the window's upper bound)."""
    prefetch_bucket_size: int
    """Elements to have in flight ahead of the computing layer (sets the window)."""
    quant: Optional[QuantSpec] = None
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    aio_kwargs: Dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    world: int = 1
    """Ranks sharing the streaming: each holds 1/world of every layer and they all-gather."""
    group: Any = None
    """The process group of those ranks (None: the default group)."""
    window: Optional[int] = None
    """Layers prefetched ahead; None: from the sizes above and free device memory."""
    min_nvme_bytes: int = MIN_NVME_BYTES


#: layers queued ahead on CUDA at least (``stage3_max_live_parameters`` still caps it)
MIN_AHEAD = 2


class LayerStreamer:
    """See the module docstring."""

    def __init__(self, model: nn.Module, decoder: Optional[nn.Module], device: torch.device,
                 settings: StreamSettings, dtype: torch.dtype,
                 checkpoint: Optional[LayerWeights] = None) -> None:
        self.device, self.settings, self.dtype = device, settings, dtype
        self.acc = get_accelerator()  # streams and events, looked up once
        self.checkpoint = checkpoint  # weights of a meta model, read layer by layer
        self._names: Dict[int, str] = {}
        self._replaced: Dict[int, nn.Parameter] = {}  # meta Parameters -> their real ones
        self.layers = decoder_layers(model)
        self.units = [[layer] for layer in self.layers]
        if decoder is not None:
            for i, block in enumerate(decoder.blocks):
                self.units[i].append(block)
        self._swap = None  # shardwise.io.swap_files.SwapFiles, made by the first NVMe layer
        per_unit = self._split(self._group_storages(model, decoder))
        self.images = [self._layout(i, items) for i, items in enumerate(per_unit)]
        self.window = self._pick_window()
        self._make_slots()
        for i, image in enumerate(self.images):  # layer by layer; each original freed once packed
            tensors = [self._real(r, t) for r, t in per_unit[i]]
            per_unit[i] = []
            self._pack(image, tensors)
            del tensors
        self._make_staging()
        self._hooks = []
        for i, mods in enumerate(self.units):
            for mod in mods:
                self._hooks.append(mod.register_forward_pre_hook(lambda m, a, i=i: self.enter(i)))
                self._hooks.append(mod.register_forward_hook(lambda m, a, o, i=i: self.leave(i)))
        self.stats = {"fetches": 0, "bytes": 0}

    # --- setup ---------------------------------------------------------------------------
    def _group_storages(self, model: nn.Module, decoder: Optional[nn.Module]):
        """storage key -> (owner units, [(ref, tensor)])."""
        unit_of: Dict[int, int] = {}
        for i, mods in enumerate(self.units):
            for mod in mods:
                for sub in mod.modules():
                    unit_of.setdefault(id(sub), i)
        roots = [model] + ([decoder] if decoder is not None else [])
        qualname = {id(m): n for n, m in model.named_modules()}
        seen: Set[int] = set()
        groups: Dict[Tuple[str, int], Tuple[Set[Any], List[Tuple[TensorRef, torch.Tensor]]]] = {}
        for root in roots:
            for sub in root.modules():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                owner = unit_of.get(id(sub), "outside")
                for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
                    for name, t in table.items():
                        if t is None or t.numel() == 0:
                            continue
                        if t.is_meta and self.checkpoint is None:
                            raise ConfigError(f"ZeRO-Inference: {name} of {type(sub).__name__} is "
                                              f"on the meta device; load weights first "
                                              f"(init_inference(..., checkpoint=DIR)).")
                        owners, refs = groups.setdefault(storage_key(t), (set(), []))
                        owners.add(owner)
                        ref = TensorRef.of(sub, name, is_param, t)
                        if id(sub) in qualname:
                            prefix = qualname[id(sub)]
                            self._names[id(ref)] = f"{prefix}.{name}" if prefix else name
                        refs.append((ref, t))
        return groups

    def _split(self, groups) -> List[List[Tuple[Region, torch.Tensor]]]:
        """Per layer, the (region, tensor) pairs it streams; resident storages moved now."""
        per_unit: List[List[Tuple[Region, torch.Tensor]]] = [[] for _ in self.units]
        for owners, refs in groups.values():
            t = refs[0][1]
            numel = t.untyped_storage().nbytes() // t.element_size()
            streamed = len(owners) == 1 and next(iter(owners)) != "outside" and \
                numel > self.settings.persistence_threshold and \
                all(r.dtype == t.dtype for r, _ in refs)
            if streamed and self.settings.quant is not None and not t.is_floating_point():
                raise ConfigError("weight_quantization streams float weights; it cannot be combined "
                                  "with dtype \"int8\" (already-quantized linears). Use one of them.")
            region = Region(t.dtype, numel, 0, [r for r, _ in refs])
            if streamed:
                per_unit[next(iter(owners))].append((region, t))
            else:
                self._make_resident(region, self._real(region, t))
        return per_unit

    def _real(self, region: Region, t: torch.Tensor) -> torch.Tensor:
        """``t``, or for a meta tensor its storage read from the checkpoint (on the host)."""
        return self.checkpoint.materialize(region, self._names) if t.is_meta else t

    def _make_resident(self, region: Region, t: torch.Tensor) -> None:
        if t.device == self.device and not region.refs[0].current().is_meta:
            return
        dev = storage_bytes(t).to(self.device)
        for ref, view in zip(region.refs, region.views(dev)):
            ref.set(view, self._replaced)

    def _layout(self, index: int, items: List[Tuple[Region, torch.Tensor]]) -> LayerImage:
        quant = self.settings.quant if items else None  # a layer that streams nothing: no groups
        offsets, size = layout([(r.dtype, r.numel) for r, _ in items], quant)
        for (region, _), off in zip(items, offsets):
            region.offset = off
        return LayerImage(index, [r for r, _ in items], size, self.dtype, quant,
                          world=self.settings.world)

    def _pack(self, image: LayerImage, tensors: List[torch.Tensor]) -> None:
        """Fill the layer's host buffer or swap file; its tensors then point at slot 0
        (a placeholder until the first fetch), so the original host copies are freed."""
        nbytes = image.shard_bytes
        to_nvme = self.settings.nvme_path is not None and nbytes >= self.settings.min_nvme_bytes
        buf = host_buffer(nbytes, pin=self.settings.pin_memory and not to_nvme)
        if image.world == 1:
            image.fill(buf, dict(enumerate(tensors)))
        else:  # this rank keeps its shard of the transfer bytes
            whole = torch.zeros(nbytes * image.world, dtype=torch.uint8)
            image.fill(whole[:image.transfer_bytes], dict(enumerate(tensors)))
            rank = self.settings.rank
            buf.copy_(whole[rank * nbytes:(rank + 1) * nbytes])
            del whole
        image.source = self._write_swap(image.index, buf) if to_nvme else HostSource(buf)
        image.bind(self.slots[0], self._replaced)

    def _write_swap(self, index: int, buf: torch.Tensor) -> NvmeSource:
        from shardwise.io.swap_files import SwapFiles
        if self._swap is None:
            self._swap = SwapFiles(self.settings.nvme_path, self.settings.rank,
                                   key="zero.offload_param.nvme_path",
                                   aio_kwargs=self.settings.aio_kwargs)
        target = self._swap.write_bytes(f"layer{index:05d}.swp", buf)
        return NvmeSource(target.path, target.nbytes)

    def _pick_window(self) -> int:
        s, n = self.settings, len(self.images)
        if s.window is not None:
            return max(1, min(s.window, n))
        per_layer = max(1, max(img.numel for img in self.images))
        live = max(2, s.max_live_parameters // per_layer)
        ahead = max(1, -(-s.prefetch_bucket_size // per_layer))
        if self.device.type == "cuda":  # >= 2 copies queued: the link never waits on Python
            ahead = max(ahead, MIN_AHEAD)
        k = max(1, min(live - 1, ahead))
        if self.device.type == "cuda":
            free, _ = self.acc.mem_get_info(self.device)
            slot = max(img.image_bytes + img.transfer_bytes for img in self.images)
            k = max(1, min(k, int(0.5 * free) // max(1, slot) - 1))
        return min(k, n)

    def _make_slots(self) -> None:
        n = min(self.window + 1, len(self.images))
        world = self.settings.world
        big = max(max(img.image_bytes, world * img.shard_bytes) for img in self.images)
        self.slots = [torch.empty(big, dtype=torch.uint8, device=self.device) for _ in range(n)]
        self.staging: List[Optional[torch.Tensor]] = [None] * n
        if self.settings.quant is not None:
            packed = max(world * img.shard_bytes for img in self.images)
            self.staging = [torch.empty(packed, dtype=torch.uint8, device=self.device) for _ in range(n)]
        self.own: List[Optional[torch.Tensor]] = [None] * n  # this rank's shard on the device
        if world > 1:
            shard = max(img.shard_bytes for img in self.images)
            self.own = [torch.empty(shard, dtype=torch.uint8, device=self.device) for _ in range(n)]
        self.owner: List[Optional[int]] = [None] * n
        self.last_use = [0] * n
        self.ready: List[Any] = [None] * n
        self.done: List[Any] = [None] * n
        self.expanded: List[Any] = [None] * n  # the slot's codes expanded (expand stream)
        self.slot_of: Dict[int, int] = {}
        self.bound: Dict[int, int] = {}
        cuda = self.device.type == "cuda"
        self.copy_stream = self.acc.Stream(self.device) if cuda else None
        # int4/int8 codes are expanded on their own stream: the copy stream only copies, so
        # the link stays busy while the previous layer is dequantized
        quant = self.settings.quant is not None
        self.expand_stream = self.acc.Stream(self.device) if cuda and quant else None
        self._views: Dict[Tuple[int, int], List[Tuple[TensorRef, torch.Tensor]]] = {}

    def _make_staging(self) -> None:
        nvme = [img.source.nbytes for img in self.images if isinstance(img.source, NvmeSource)]
        self.nvme_staging = [host_buffer(max(nvme), pin=self.settings.pin_memory) for _ in range(2)] \
            if nvme else []
        self.stage_free: List[Any] = [None, None]
        self.pending: Optional[Tuple[int, int, Any]] = None  # (layer, staging buffer, request)
        self._seq = 0
        self._current: Optional[int] = None

    # --- the pipeline ----------------------------------------------------------------------
    def _protected(self) -> Set[int]:
        cur = self._current if self._current is not None else 0
        n = len(self.images)
        return {(cur + d) % n for d in range(self.window + 1)}

    def _pick_slot(self) -> int:
        keep = self._protected()
        free = [s for s in range(len(self.slots)) if self.owner[s] is None]
        if free:
            return free[0]
        candidates = [s for s in range(len(self.slots)) if self.owner[s] not in keep]
        if not candidates:
            candidates = list(range(len(self.slots)))
        return min(candidates, key=lambda s: self.last_use[s])

    def _next_nvme(self, j: int) -> Optional[int]:
        n = len(self.images)
        for d in range(1, n + 1):
            k = (j + d) % n
            if isinstance(self.images[k].source, NvmeSource):
                return k
        return None

    def _start_read(self, j: int, buf_index: int) -> None:
        ev = self.stage_free[buf_index]
        if ev is not None:
            ev.synchronize()  # the previous device copy out of this buffer has finished
        src = self.images[j].source
        buf = self.nvme_staging[buf_index][:src.nbytes]
        self.pending = (j, buf_index, self._swap.reader.read_request(buf, src.path, 0))

    def _host_bytes(self, j: int) -> Tuple[torch.Tensor, Optional[int]]:
        src = self.images[j].source
        if isinstance(src, HostSource):
            return src.buffer, None
        if self.pending is None or self.pending[0] != j:
            busy = self.pending[1] if self.pending is not None else 1
            if self.pending is not None:
                self.pending[2].wait()
                self.pending = None
            self._start_read(j, 1 - busy)
        _, b, req = self.pending
        req.wait()
        self.pending = None
        return self.nvme_staging[b], b

    def fetch(self, j: int) -> int:
        """Make sure layer ``j`` is in (or on its way to) a device slot; returns the slot."""
        if j in self.slot_of:
            return self.slot_of[j]
        slot = self._pick_slot()
        old = self.owner[slot]
        if old is not None:
            del self.slot_of[old]
        img = self.images[j]
        host, stage = self._host_bytes(j)
        n = img.shard_bytes
        if self.copy_stream is not None:
            with self.acc.stream(self.copy_stream):
                if self.done[slot] is not None:
                    self.copy_stream.wait_event(self.done[slot])
                if self.expanded[slot] is not None:  # a prefetched layer never computed
                    self.copy_stream.wait_event(self.expanded[slot])
                self._copy(img, host[:n], slot)
                ev = self.acc.Event()
                ev.record(self.copy_stream)
            if stage is not None:
                self.stage_free[stage] = ev
            if self.expand_stream is not None and img.world == 1:
                ev = self.expanded[slot] = self._expand_async(img, slot, ev)
            self.ready[slot] = ev
        else:
            self._copy(img, host[:n], slot)
        self.owner[slot], self.slot_of[j] = j, slot
        self._seq += 1
        self.last_use[slot] = self._seq
        self.stats["fetches"] += 1
        self.stats["bytes"] += n
        if stage is not None:
            nxt = self._next_nvme(j)
            if nxt is not None and nxt not in self.slot_of and self.pending is None:
                self._start_read(nxt, 1 - stage)
        return slot

    def _copy(self, img: LayerImage, host: torch.Tensor, slot: int) -> None:
        """One copy of the layer's bytes (its shard at world size > 1) into the slot, or into
        the slot's staging buffer when quantized (expanded here on CPU, on the expand
        stream on CUDA: ``_expand_async``)."""
        non_blocking = self.device.type == "cuda"
        if img.world > 1:
            self._gather(img, host, slot, non_blocking)
        elif img.quant is None:
            self.slots[slot][:host.numel()].copy_(host, non_blocking=non_blocking)
        else:
            staged = self.staging[slot][:host.numel()]
            staged.copy_(host, non_blocking=non_blocking)
            if self.expand_stream is None:
                img.expand(staged, self.slots[slot])

    def _expand_async(self, img: LayerImage, slot: int, copied: Any) -> Any:
        """Dequantize the slot's staged codes on the expand stream once ``copied`` fired;
        returns the event the compute waits for. The next copy into this slot's staging
        buffer waits for the compute of the layer (so for this expansion too)."""
        with self.acc.stream(self.expand_stream):
            self.expand_stream.wait_event(copied)
            img.expand(self.staging[slot][:img.shard_bytes], self.slots[slot])
            ev = self.acc.Event()
            ev.record(self.expand_stream)
        return ev

    def _gather(self, img: LayerImage, host: torch.Tensor, slot: int, non_blocking: bool) -> None:
        """World size > 1: copy this rank's shard up, all-gather the layer, expand if quantized."""
        from ..comm.collectives import all_gather_flat
        own = self.own[slot][:host.numel()]
        own.copy_(host, non_blocking=non_blocking)
        dest = self.slots[slot] if img.quant is None else self.staging[slot]
        dest = dest[:img.world * host.numel()]
        all_gather_flat(dest, own, group=self.settings.group)  # (comm/ falls back on gloo)
        if img.quant is not None:
            img.expand(dest, self.slots[slot])

    def enter(self, i: int) -> None:
        """Pre-hook of layer ``i``: its weights ready and bound; the next ``k`` layers on their way."""
        self._current = i
        slot = self.fetch(i)
        if self.copy_stream is not None and self.ready[slot] is not None:
            self.acc.current_stream(self.device).wait_event(self.ready[slot])
        if self.bound.get(i) != slot:
            self._bind(i, slot)
            self.bound[i] = slot
        self._seq += 1
        self.last_use[slot] = self._seq
        n = len(self.images)
        for d in range(1, self.window + 1):
            self.fetch((i + d) % n)

    def _bind(self, i: int, slot: int) -> None:
        """Point layer ``i``'s tensors at their views of ``slot`` (views built once per pair)."""
        views = self._views.get((i, slot))
        if views is None:
            views = [(ref, view) for region in self.images[i].regions
                     for ref, view in zip(region.refs, region.views(self.slots[slot]))]
            self._views[(i, slot)] = views
        for ref, view in views:
            ref.set(view)

    def leave(self, i: int) -> None:
        """Forward hook of layer ``i``: mark its slot reusable once its compute has run."""
        if self.copy_stream is not None:
            ev = self.acc.Event()
            ev.record(self.acc.current_stream(self.device))
            self.done[self.slot_of[i]] = ev

    # --- reporting and teardown ----------------------------------------------------------
    @property
    def bytes_per_pass(self) -> int:
        """Bytes one forward pass streams when no layer stays in a slot."""
        return sum(img.shard_bytes for img in self.images)

    def device_bytes(self) -> int:
        """Device memory held by the slots."""
        return sum(s.numel() for s in self.slots) + sum(s.numel() for s in self.staging if s is not None)

    @property
    def nvme_dir(self) -> Optional[str]:
        return None if self._swap is None else str(self._swap.path)

    def read_swap_files(self) -> int:
        """Read every NVMe layer's swap file once, synchronously, through the streamer's own
        reader and staging buffer (benchmarks time this as the disk's direct-read speed);
        returns the bytes read, 0 when no layer is on NVMe."""
        if self.pending is not None:  # a read-ahead may be filling a staging buffer
            self.pending[2].wait()
            self.pending = None
        total = 0
        for img in self.images:
            src = img.source
            if isinstance(src, NvmeSource):
                self._swap.reader.sync_pread(self.nvme_staging[0][:src.nbytes], src.path, 0)
                total += src.nbytes
        return total

    def close(self) -> None:
        """Remove the hooks, wait for IO and delete the swap files."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.pending is not None:
            self.pending[2].wait()
            self.pending = None
        if self._swap is not None:
            self._swap.close()

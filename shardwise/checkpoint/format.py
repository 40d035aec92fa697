"""The on-disk checkpoint format: file layout, a streaming safetensors writer, a verifying
slice reader, the JSON metadata helpers and tag rules.

A checkpoint is a folder per tag::

    save_dir/
      latest                                  the newest complete tag (plain text)
      global_step20/
        shardwise_meta.json                   written last: versions, config, stage, world size,
                                              counters, parameter table, checksums of every file
        rank00000-of-00002.safetensors        this rank's slices: weights, fp32 masters, states
        rank00000-of-00002.json               this rank's index: tensor entries + crc32s, RNG,
        ...                                   scalar optimizer state, dataloader position

Every tensor entry is one slice ``[start, end)`` of a flattened parameter, keyed
``"{kind}/{name}/{start}"`` (kind: ``weight``, ``master``, ``state.exp_avg``, ``buffer``, ...),
so any world size and any ZeRO stage can read any checkpoint. The data files are plain
safetensors (readable by ``safetensors.safe_open``); nothing is unpickled on load.

Integrity: each data file's record holds its size, the crc32 of its header and a crc32 per
32 MiB chunk of every tensor (together they cover every byte of the file); readers check the
size and the header when they open a file and each chunk's crc32 when they read a tensor, so
a truncated or corrupted file raises a :class:`CheckpointError` naming the file instead of
loading garbage. crc32 was chosen over blake2b because zlib's crc32 runs at ~2 GB/s per core
(blake2b ~0.9 GB/s); chunk-wise crcs run on a thread pool while the data is written, so the
checksum scales with cores and costs no write throughput.

Speed: the writer (``shardwise.io.stream_writer.StreamWriter``) keeps the disk busy
instead of running the device-to-host copy, the crc and the write of each chunk one after
the other: device tensors go through a ring of pinned host buffers with asynchronous
copies (the next chunk copies while this one is written), CPU tensors are written from their own memory, crcs run
on a pool, and on Linux the kernel is told to start writing back every WRITEBACK_BYTES so
the final fsync waits for the tail only. None of it changes the bytes on disk.
"""
from __future__ import annotations

import base64
import json
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from ..errors import CheckpointError
from ..io.checksums import ChunkCrcs, chunk_crcs as _chunk_crcs, crc_value
from ..io.checksums import file_crc32 as _file_crc32
from ..io.pinned_ring import HostRing, ring_slots
from ..io.read_pool import ThreadFiles, read_spans, read_workers, readinto_full
from ..io.stream_writer import SYNC_FILE_RANGE_WRITE, StreamWriter, Writeback, sync_file_range
from .atomic import atomic_open

FORMAT_NAME = "shardwise-checkpoint"
FORMAT_VERSION = 1
META_FILE = "shardwise_meta.json"
LATEST_FILE = "latest"

#: Bytes handed to ``write`` per call; large enough to reach disk speed, small enough that a
#: device-to-host copy of one chunk stays cheap in memory.
CHUNK_BYTES = 32 * 1024 * 1024

_DTYPE_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPE_TO_ST[getattr(torch, _name)] = _code
_ST_TO_DTYPE = {code: dtype for dtype, code in _DTYPE_TO_ST.items()}

_WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)),
                     *(f"LPT{i}" for i in range(1, 10))}
_BAD_TAG_CHARS = re.compile(r'[\\/:*?"<>|\x00-\x1f]')


# --------------------------------------------------------------------------- names


def rank_file_stem(rank: int, world_size: int) -> str:
    """``rank00003-of-00008``: sorts correctly and has no ':' (Windows-safe)."""
    return f"rank{rank:05d}-of-{world_size:05d}"


def tensor_key(kind: str, name: str, start: int) -> str:
    return f"{kind}/{name}/{start}"


def validate_tag(tag: str) -> str:
    """Return ``tag`` if it is a safe folder name on every OS, else raise CheckpointError."""
    if not isinstance(tag, str) or not tag:
        raise CheckpointError(f"checkpoint tag {tag!r} must be a non-empty string, e.g. 'global_step100'.")
    bad = sorted(set(_BAD_TAG_CHARS.findall(tag)))
    if bad:
        raise CheckpointError(
            f"checkpoint tag {tag!r} contains {bad}; tags become folder names, so path separators, "
            "':' and the characters *?\"<>| are not allowed (Windows rejects them). "
            "Use letters, digits, '_', '-' or '.', e.g. 'global_step100'.")
    if tag.startswith(".") or tag.endswith((".", " ")):
        raise CheckpointError(
            f"checkpoint tag {tag!r} starts with '.' or ends with '.' or a space; shardwise uses "
            "dot-prefixed folders for in-progress saves and Windows strips trailing dots. "
            "Rename the tag, e.g. 'global_step100'.")
    if tag.split(".")[0].upper() in _WINDOWS_RESERVED:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is a reserved device name on Windows; choose another tag.")
    return tag


def resolve_tag(checkpoint_dir: Union[str, Path], tag: Optional[str]) -> Optional[str]:
    """The tag to load: ``tag`` itself, else the content of ``checkpoint_dir/latest``.

    Returns None when no tag was given and there is no ``latest`` file.
    """
    if tag is not None:
        return validate_tag(str(tag))
    latest = Path(checkpoint_dir) / LATEST_FILE
    if not latest.is_file():
        return None
    return validate_tag(latest.read_text(encoding="utf-8").strip())


# --------------------------------------------------------------------------- dtypes / JSON


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def str_to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata; it was written by a "
                              "newer torch or is corrupted.")
    return dtype


def to_jsonable(value: Any, where: str) -> Any:
    """Encode ``value`` for JSON: tensors of ≤ 64 elements, bytes, tuples and nested containers
    are tagged so :func:`from_jsonable` can rebuild them. Larger tensors must go to safetensors.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() > 64:
            raise CheckpointError(f"{where}: tensor of {value.numel()} elements cannot be stored in "
                                  "JSON metadata; pass large tensors in client_state's top level "
                                  "(stored in safetensors) instead.")
        t = value.detach().cpu()
        return {"__tensor__": t.reshape(-1).tolist(), "dtype": dtype_to_str(t.dtype),
                "shape": list(t.shape)}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"__tuple__": [to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where}: key {k!r} of type {type(k).__name__} cannot be "
                                      "stored; use str or int keys.")
            out[str(k) if isinstance(k, str) else f"__int__{k}"] = to_jsonable(v, f"{where}[{k!r}]")
        return out
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalars
        return value.item()
    raise CheckpointError(
        f"{where}: value of type {type(value).__name__} cannot be stored. shardwise checkpoints "
        "never pickle (a pickle can run code when loaded); store JSON-able values "
        "(numbers, strings, lists, dicts) or torch tensors.")


def from_jsonable(value: Any) -> Any:
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=str_to_dtype(value["dtype"])).reshape(
                value["shape"])
        if "__bytes__" in value:
            return base64.b64decode(value["__bytes__"])
        if "__tuple__" in value:
            return tuple(from_jsonable(v) for v in value["__tuple__"])
        return {(int(k[7:]) if k.startswith("__int__") else k): from_jsonable(v)
                for k, v in value.items()}
    return value


def dumps_json(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=False, allow_nan=True).encode("utf-8")


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing; the checkpoint is incomplete (a save was "
                              "interrupted?) or the path is wrong.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} {path} is not valid JSON ({exc}); the file is truncated or "
                              "corrupted. Load an earlier tag.") from None


# --------------------------------------------------------------------------- writer


@dataclass
class TensorItem:
    """One tensor to write: its key, dtype, shape and the tensor (or a function producing it,
    called only when its turn comes, so a consolidating writer holds one tensor at a time)."""

    key: str
    dtype: torch.dtype
    shape: Sequence[int]
    source: Union[torch.Tensor, Callable[[], torch.Tensor]]
    info: Dict[str, Any] = field(default_factory=dict)
    """Extra fields copied into this tensor's index entry (param name, kind, start, end)."""

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=self.dtype).element_size()



#: Pieces smaller than this get their crc32 on the writing thread (see :class:`ChunkCrcs`).
_INLINE_CRC_BYTES = 1024 * 1024

#: After this many new bytes the writer asks the kernel to start writing them to disk
#: (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), so a save takes
#: max(produce, disk) instead of produce + disk. 0 turns it off (the benchmark's
#: ``--no-writeback`` A/B switch).
WRITEBACK_BYTES = 64 * 1024 * 1024

# The IO pieces live in shardwise.io; these names are the seams the tests patch.
_SYNC_FILE_RANGE_WRITE = SYNC_FILE_RANGE_WRITE
_sync_file_range = sync_file_range
_ring_slots = ring_slots
_HostRing = HostRing
_read_workers = read_workers


def chunk_crcs(buf) -> List[int]:
    """The per-chunk crc32 list of a byte buffer, as the writer records it."""
    return _chunk_crcs(buf, CHUNK_BYTES)


def _record_io(write_bytes: int = 0, read_bytes: int = 0) -> None:
    try:
        from ..utils.diagnostics import record_io  # written by another engineer; optional
    except ImportError:
        return
    try:
        record_io(write_bytes=write_bytes, read_bytes=read_bytes)
    except Exception:  # accounting must never break a save
        pass


def write_safetensors(path: Union[str, Path], items: Sequence[TensorItem],
                      metadata: Optional[Dict[str, str]] = None, fsync: bool = True,
                      _stage_host: bool = False) -> Dict[str, Any]:
    """Stream ``items`` into a safetensors file at ``path`` (atomically) and return its record.

    The header is computed from the items' shapes first, then each tensor's bytes are written
    in chunks through :class:`~shardwise.io.stream_writer.StreamWriter`, so host memory stays one tensor for producers
    plus a few CHUNK_BYTES buffers for device tensors. The record (``size``,
    ``header_crc32``, ``crc_chunk_bytes``, ``tensors``: key → offsets, crc32 per chunk, info)
    goes into the checkpoint's JSON index and is what :class:`SliceFileReader` verifies.
    """
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for item in items:
        if item.dtype not in _DTYPE_TO_ST:
            raise CheckpointError(f"tensor {item.key!r} has dtype {item.dtype}, which safetensors "
                                  "cannot store.")
        if item.key in header:
            raise CheckpointError(f"tensor key {item.key!r} appears twice in {path}.")
        header[item.key] = {"dtype": _DTYPE_TO_ST[item.dtype], "shape": [int(s) for s in item.shape],
                            "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors pads the header to 8 bytes
    prefix = struct.pack("<Q", len(header_bytes)) + header_bytes
    crcs = ChunkCrcs(_INLINE_CRC_BYTES)
    entries: Dict[str, Any] = {}
    try:
        with atomic_open(path, fsync=fsync) as f:
            f.write(prefix)
            # writeback only when the file is to be durable: with fsync=False leave the cache be
            writeback = Writeback(f, _sync_file_range() if fsync else None, WRITEBACK_BYTES)
            writer = StreamWriter(f, len(prefix), len(items), crcs, writeback, CHUNK_BYTES,
                                  stage_host=_stage_host,
                                  ring=_HostRing(CHUNK_BYTES, _ring_slots()))
            for index, item in enumerate(items):
                tensor = item.source() if callable(item.source) else item.source
                if tensor.dtype != item.dtype or tensor.numel() * tensor.element_size() != item.nbytes:
                    raise CheckpointError(
                        f"tensor {item.key!r}: planned {item.dtype} x {list(item.shape)} but got "
                        f"{tensor.dtype} x {list(tensor.shape)} while writing {path}.")
                writer.add(index, tensor)
                del tensor
            writer.finish()
    finally:
        crcs.close()
    for item, mine in zip(items, writer.crcs):
        entries[item.key] = {"offsets": header[item.key]["data_offsets"],
                             "crc32": [crc_value(c) for c in mine],
                             "dtype": dtype_to_str(item.dtype), "shape": [int(s) for s in item.shape],
                             **item.info}
    size = len(prefix) + offset
    _record_io(write_bytes=size)
    return {"size": size, "header_crc32": zlib.crc32(prefix), "crc_chunk_bytes": CHUNK_BYTES,
            "tensors": entries}


# --------------------------------------------------------------------------- reader


class SliceFileReader:
    """Reads tensors from one checkpoint data file, verifying them against its record.

    Opening checks the file size (truncation) and the header's crc32; each :meth:`read`
    checks the crc32 of every chunk of the tensor. Reads use plain seek + readinto into a
    fresh buffer: no mmap (so a file can be replaced on Windows while a reader is alive) and
    no pickle.

    Speed: a tensor of several crc chunks is read chunk-parallel on :func:`shardwise.io.read_pool.read_pool`, each
    worker reading its chunk straight into its slice of the output buffer and checksumming it
    right away, while it is still in the CPU cache. One thread reading a whole tensor and
    then checksumming it caps at one core's page-fault + copy + crc speed (~1.5 GB/s); file
    reads and zlib.crc32 release the GIL, so the chunks scale with cores. Every thread
    reads through its own file handle (a shared handle's seek position would race), opened
    on first use and closed by :meth:`close`. ``read`` may be called from several threads.
    """

    def __init__(self, path: Union[str, Path], record: Dict[str, Any]) -> None:
        self.path = Path(path)
        self.record = record
        self._files = ThreadFiles(self.path)
        try:
            actual = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {self.path} is missing; the checkpoint is "
                                  "incomplete or was moved. Load an earlier tag.") from None
        if actual != record["size"]:
            raise CheckpointError(
                f"checkpoint file {self.path} has {actual} bytes but its metadata records "
                f"{record['size']}; the file is truncated or was overwritten. Load an earlier tag.")
        f = self._files.get()
        head = bytearray(8)
        got = readinto_full(f, head)
        (n,) = struct.unpack("<Q", head) if got == 8 else (-1,)
        body = bytearray(max(n, 0) if n <= actual else 0)
        got_body = readinto_full(f, body)
        if n < 0 or got_body != n or zlib.crc32(body, zlib.crc32(head)) != record["header_crc32"]:
            self.close()
            raise CheckpointError(f"checkpoint file {self.path}: header checksum mismatch; the file "
                                  "is corrupted. Load an earlier tag.")
        self._data_start = 8 + n

    def read(self, key: str) -> torch.Tensor:
        """The tensor stored under ``key`` (CPU, its saved dtype and shape), verified."""
        entry = self.record["tensors"].get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint file {self.path} has no tensor {key!r}.")
        begin, end = entry["offsets"]
        nbytes = end - begin
        buf = torch.empty(nbytes, dtype=torch.uint8)
        raw = buf.numpy()
        chunk = int(self.record.get("crc_chunk_bytes", CHUNK_BYTES))
        spans = [(lo, min(lo + chunk, nbytes)) for lo in range(0, nbytes, chunk)]
        offset = self._data_start + begin
        results = read_spans(self._files.read_at, offset, raw, spans, _read_workers())
        got = sum(n for n, _ in results)
        if got != nbytes:
            raise CheckpointError(f"checkpoint file {self.path}: tensor {key!r} is truncated "
                                  f"({got} of {nbytes} bytes).")
        got_crcs = [crc for _, crc in results]
        bad = [i for i, want in enumerate(entry["crc32"]) if i >= len(got_crcs) or got_crcs[i] != want]
        if bad or len(entry["crc32"]) != len(spans):
            raise CheckpointError(
                f"checkpoint file {self.path}: checksum mismatch in tensor {key!r}; the file is "
                "corrupted (disk error or a partial copy). Load an earlier tag or re-copy the file.")
        _record_io(read_bytes=nbytes)
        dtype = str_to_dtype(entry["dtype"])
        if dtype == torch.bool:
            return buf.view(torch.bool).reshape(entry["shape"])
        return buf.view(dtype).reshape(entry["shape"])

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> "SliceFileReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def file_crc32(path: Union[str, Path]) -> int:
    """crc32 of a whole file, streamed (used by :func:`verify_files` and the tests)."""
    return _file_crc32(path, CHUNK_BYTES)


def file_size(path: Union[str, Path]) -> int:
    return os.stat(path).st_size

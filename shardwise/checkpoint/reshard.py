"""Read any slice range of any parameter from a checkpoint written at any world size.

A checkpoint stores each parameter as slices ``[start, end)`` of its flattened elements,
one slice per writing rank. :class:`CheckpointReader` indexes those slices and assembles
whatever range the reading rank owns now: ``read_range("master", "fc.weight", 100, 300)``
may take elements from two files of a 2-rank checkpoint or from one file of a 1-rank one.
That is the whole trick behind resuming on a different world size or ZeRO stage: each stage
only differs in which ranges a rank owns.
"""
from __future__ import annotations

import bisect
import collections
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from ..errors import CheckpointError
from .format import (FORMAT_NAME, FORMAT_VERSION, META_FILE, SliceFileReader, from_jsonable,
                     read_json, resolve_tag, str_to_dtype)


#: :meth:`CheckpointReader.read_ranges` keeps at most this many bytes and this many reads in
#: flight (queued, running or done but not yet consumed), besides the one being consumed.
READ_AHEAD_BYTES = 1 << 30
READ_AHEAD_READS = 8


def _read_ahead_workers() -> int:
    """Reads of different tensors at once: on top of the chunk-parallel reads of big tensors,
    so that a model of many small (single-chunk) tensors also loads on several cores."""
    return max(1, min(4, os.cpu_count() or 2))


@dataclass(frozen=True)
class Piece:
    """One stored slice of one (kind, parameter)."""

    start: int
    end: int
    file: str
    key: str


class CheckpointReader:
    """A verified, read-only view of one checkpoint tag.

    ``meta`` is the global metadata (``shardwise_meta.json``); ``rank_index(r)`` the index
    written by rank ``r``; ``params`` maps each parameter name to its shape, dtype and
    whether it was trainable. Open data files are cached; use as a context manager or call
    :meth:`close`. Reads may run on several threads at once (the engine's load reads ahead on
    a few workers); :meth:`close` must wait until they are done.
    """

    def __init__(self, checkpoint_dir: Union[str, Path], tag: Optional[str] = None) -> None:
        root = Path(checkpoint_dir)
        resolved = resolve_tag(root, tag)
        if resolved is None:
            raise CheckpointError(
                f"no checkpoint tag given and {root / 'latest'} does not exist; pass tag=... "
                "(a folder name inside the checkpoint dir) or point at the folder that holds "
                "'latest'.")
        self.root = root
        self.tag = resolved
        self.path = root / resolved
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint folder {self.path} does not exist; available tags: "
                                  f"{available_tags(root) or 'none'}.")
        self.meta: Dict[str, Any] = read_json(self.path / META_FILE, "checkpoint metadata")
        if self.meta.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{self.path / META_FILE} is not a shardwise checkpoint "
                                  f"(format={self.meta.get('format')!r}).")
        if int(self.meta.get("format_version", 0)) > FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path} was written in checkpoint format v{self.meta['format_version']}, "
                f"newer than this shardwise reads (v{FORMAT_VERSION}); upgrade shardwise.")
        self.world_size = int(self.meta["world_size"])
        self._indexes: Dict[int, Dict[str, Any]] = {}
        for rank in range(self.world_size):
            self._indexes[rank] = self._load_index(rank)
        self.params: Dict[str, Dict[str, Any]] = self.meta["params"]
        self._pieces: Dict[Tuple[str, str], List[Piece]] = {}
        for rank, index in self._indexes.items():
            for fname, record in index["files"].items():
                for key, entry in record["tensors"].items():
                    piece = Piece(int(entry["start"]), int(entry["end"]), fname, key)
                    self._pieces.setdefault((entry["kind"], entry["param"]), []).append(piece)
        self._kinds: Dict[str, List[str]] = {}
        for (kind, name), pieces in self._pieces.items():
            pieces.sort(key=lambda p: p.start)
            self._kinds.setdefault(name, []).append(kind)
        self._open: Dict[str, SliceFileReader] = {}
        self._lock = threading.Lock()  # guards _open and _cache
        self._cache: Tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def _load_index(self, rank: int) -> Dict[str, Any]:
        name = self.meta["rank_indexes"][rank]["file"]
        path = self.path / name
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint index {path} is missing; the checkpoint is "
                                  "incomplete. Load an earlier tag.") from None
        if zlib.crc32(raw) != self.meta["rank_indexes"][rank]["crc32"]:
            raise CheckpointError(f"checkpoint index {path}: checksum mismatch; the file is "
                                  "corrupted or truncated. Load an earlier tag.")
        return read_json(path, "checkpoint index")

    # ------------------------------------------------------------------ queries

    def rank_index(self, rank: int) -> Dict[str, Any]:
        return self._indexes[rank]

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self._pieces

    def kinds(self, name: str) -> List[str]:
        """Every kind stored for ``name`` (``weight``, ``master``, ``state.exp_avg``, ...)."""
        return sorted(self._kinds.get(name, ()))

    def names(self, kind: str) -> List[str]:
        return [n for (k, n) in self._pieces if k == kind]

    def numel(self, name: str) -> int:
        n = 1
        for s in self.params[name]["shape"]:
            n *= int(s)
        return n

    # ------------------------------------------------------------------ reading

    def element_size(self, kind: str, name: str) -> int:
        """Bytes per element of the stored ``(kind, name)`` (0 when it is not stored)."""
        pieces = self._pieces.get((kind, name))
        if not pieces:
            return 0
        entry = self._record(pieces[0].file)["tensors"][pieces[0].key]
        return torch.empty((), dtype=str_to_dtype(entry["dtype"])).element_size()

    def _record(self, fname: str) -> Optional[Dict[str, Any]]:
        record = None
        for index in self._indexes.values():
            record = index["files"].get(fname, record)
        return record

    def _file(self, fname: str) -> SliceFileReader:
        with self._lock:
            reader = self._open.get(fname)
            if reader is None:
                reader = SliceFileReader(self.path / fname, self._record(fname))
                self._open[fname] = reader
            return reader

    def _piece_tensor(self, piece: Piece, whole: bool) -> torch.Tensor:
        """The stored tensor of ``piece``, flat. One-entry cache for partial reads:
        consecutive ranges of one parameter usually hit the same piece, and a partial read
        only copies out of it. A piece handed out ``whole`` belongs to the caller (it may
        become optimizer state, changed in place), so it is always a fresh read and never
        cached: no other thread can be handed or be copying from the same tensor."""
        ckey = f"{piece.file}|{piece.key}"
        with self._lock:
            if not whole and self._cache[0] == ckey:
                return self._cache[1]
            self._cache = (None, None)  # free the old piece before reading the new one
        data = self._file(piece.file).read(piece.key).reshape(-1)
        if not whole:
            with self._lock:
                self._cache = (ckey, data)
        return data

    def read_range(self, kind: str, name: str, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Flat elements ``[start, end)`` of ``(kind, name)`` as a new CPU tensor (saved dtype)."""
        pieces = self._pieces.get((kind, name))
        if pieces is None:
            raise CheckpointError(f"checkpoint {self.path} has no {kind!r} for parameter {name!r}; "
                                  f"stored kinds for it: {self.kinds(name) or 'none'}.")
        end = self.numel(name) if end is None else end
        out: Optional[torch.Tensor] = None
        pos = start
        i = max(0, bisect.bisect_right([p.start for p in pieces], start) - 1)
        while pos < end and i < len(pieces):
            piece = pieces[i]
            i += 1
            if piece.end <= pos or piece.start == piece.end:
                continue
            if piece.start > pos:
                break
            whole = out is None and piece.start == start and piece.end == end
            data = self._piece_tensor(piece, whole)
            if whole:
                return data
            if out is None:
                out = torch.empty(end - start, dtype=data.dtype)
            take = min(end, piece.end) - pos
            out[pos - start:pos - start + take] = data[pos - piece.start:pos - piece.start + take]
            pos += take
        if pos < end:
            raise CheckpointError(f"checkpoint {self.path}: elements [{pos}, {end}) of {kind!r} "
                                  f"{name!r} are stored in no file; the checkpoint is incomplete.")
        if out is None:
            dtype = self.params.get(name, {}).get("dtype", "float32") if kind == "weight" else "float32"
            out = torch.empty(0, dtype=str_to_dtype(dtype))
        return out

    def read_ranges(self, requests: Iterable[Tuple[str, str, int, int]],
                    workers: Optional[int] = None) -> Iterator[torch.Tensor]:
        """``read_range(kind, name, start, end)`` of each request, yielded in order, read ahead.

        Why: a load is a long list of reads, each followed by the caller's work on it (a copy
        to the device, a cast). Done one after the other, nothing overlaps and a tensor of one
        crc chunk is read and checksummed on one core. Here ``workers`` threads run the next
        reads while the caller works, at most READ_AHEAD_READS reads and READ_AHEAD_BYTES
        bytes ahead of it (and always the next one), so host memory stays bounded. An error
        of a read (e.g. a CheckpointError for a corrupted file) is raised unchanged when the
        caller reaches that read. Close the generator (``contextlib.closing``) before the
        reader: closing cancels the queued reads and waits for the running ones.
        """
        requests = list(requests)
        sizes = [(end - start) * self.element_size(kind, name) for kind, name, start, end in requests]
        pool = ThreadPoolExecutor(max_workers=workers or _read_ahead_workers(),
                                  thread_name_prefix="shardwise-readahead")
        pending: Deque[Tuple[int, "Future[torch.Tensor]"]] = collections.deque()
        ahead = 0  # bytes of the reads in `pending`
        nxt = 0

        def fill() -> None:
            nonlocal ahead, nxt
            while nxt < len(requests) and (not pending or (
                    len(pending) < READ_AHEAD_READS and ahead + sizes[nxt] <= READ_AHEAD_BYTES)):
                pending.append((sizes[nxt], pool.submit(self.read_range, *requests[nxt])))
                ahead += sizes[nxt]
                nxt += 1

        try:
            fill()
            while pending:
                size, head = pending.popleft()
                ahead -= size
                fill()  # the freed budget goes to the next reads before we wait for this one
                yield head.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def read_full(self, kind: str, name: str) -> torch.Tensor:
        """The whole ``(kind, name)`` tensor in its global shape."""
        return self.read_range(kind, name).reshape(self.params[name]["shape"])

    def read_fp32(self, name: str) -> torch.Tensor:
        """The best fp32 value of a parameter: its fp32 master when stored, else its weight."""
        kind = "master" if self.has("master", name) else "weight"
        return self.read_full(kind, name).float()

    def client_state(self) -> Dict[str, Any]:
        """The ``client_state`` dict given to ``save_checkpoint`` (tensors included)."""
        state = from_jsonable(self.meta.get("client_state") or {})
        for name in self.names("client"):
            state[name] = self.read_whole("client", name)
        return state

    def read_whole(self, kind: str, name: str) -> torch.Tensor:
        """A tensor stored unsliced (buffers, client tensors) in its saved shape."""
        pieces = self._pieces.get((kind, name))
        if not pieces:
            raise CheckpointError(f"checkpoint {self.path} has no {kind!r} named {name!r}.")
        return self._file(pieces[0].file).read(pieces[0].key)

    def close(self) -> None:
        with self._lock:
            readers, self._open = list(self._open.values()), {}
            self._cache = (None, None)
        for reader in readers:
            reader.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def available_tags(checkpoint_dir: Union[str, Path]) -> List[str]:
    """Complete tags (folders holding a metadata file) under ``checkpoint_dir``."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and (p / META_FILE).is_file())

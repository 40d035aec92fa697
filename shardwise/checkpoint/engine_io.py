"""``engine.save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` (DeepSpeed's names).

Saving: every rank writes the slices it owns (``engine.shard_views()``) of weights, fp32
masters and optimizer states into its own safetensors file, plus a small JSON index, inside
a hidden staging folder ``.<tag>.partial``. After a barrier, rank 0 writes the metadata
(which checksums every index), renames the staging folder to ``<tag>`` and only then moves
``latest``. A save killed at any point therefore leaves the previous tags and ``latest``
untouched.

Loading: every rank reads the ranges it owns *now* through
:class:`~shardwise.checkpoint.reshard.CheckpointReader`, whatever world size and stage wrote
them, writes them into its views and lets the engine make the other copies consistent
(``engine.refresh_after_load``).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .. import comm
from ..comm.topology import global_rank
from ..errors import CheckpointError
from ..utils.logging import log_dist, logger
from ..zero.shard_view import ShardView
from . import async_save as _async
from .atomic import atomic_write_bytes, atomic_write_text, fsync_dir
from .contract import COUNTERS, CheckpointableEngine
from .format import (FORMAT_NAME, FORMAT_VERSION, LATEST_FILE, META_FILE, TensorItem, dtype_to_str,
                     dumps_json, from_jsonable, rank_file_stem, read_json, resolve_tag,
                     tensor_key, to_jsonable, validate_tag, write_safetensors)
from .engine_state import (_aliases, _config_dict, _grad_accum, _hf_config, _inner_optimizer,
                           _loss_scaler, _persistent_buffers, _rng_state, _set_rng_state, _stage)
from .reshard import CheckpointReader

PathLike = Union[str, "os.PathLike[str]"]
Engine = CheckpointableEngine
"""What every function here takes (``contract.CheckpointableEngine``)."""

#: Test hook: ``SHARDWISE_CKPT_TEST_DIE_AFTER_FILES=n`` makes this process ``os._exit(1)``
#: right after it finished writing its n-th checkpoint file (counted per process), so the
#: crash-safety test can kill a save at a chosen file.
DIE_AFTER_ENV = "SHARDWISE_CKPT_TEST_DIE_AFTER_FILES"
_files_written = 0


def _file_done() -> None:
    global _files_written
    _files_written += 1
    limit = os.environ.get(DIE_AFTER_ENV)
    if limit and _files_written >= int(limit):
        os._exit(1)


# --------------------------------------------------------------------------- collectives


def _dist_on(engine: Engine) -> bool:
    return comm.is_initialized() and engine.world_size > 1


def _barrier(engine: Engine) -> None:
    if _dist_on(engine):
        comm.barrier(group=engine.dp_group)


def _gather_objects(engine: Engine, obj: Any) -> List[Any]:
    if not _dist_on(engine):
        return [obj]
    out: List[Any] = [None] * engine.world_size
    comm.all_gather_object(out, obj, group=engine.dp_group)
    return out


def _check_tag_across_ranks(engine: Engine, tag: str) -> None:
    mode = engine.checkpoint_settings().tag_validation
    if mode == "IGNORE" or not _dist_on(engine):
        return
    crc = zlib.crc32(tag.encode("utf-8"))
    crcs = _gather_objects(engine, crc)
    if len(set(crcs)) == 1:
        return
    msg = (f"checkpoint tag {tag!r} differs across ranks (checkpoint.tag_validation={mode}); every "
           "rank must pass the same tag to save_checkpoint, e.g. tag=f'global_step{engine.global_steps}'.")
    if mode == "FAIL":
        raise CheckpointError(msg)
    logger.warning(msg)


# --------------------------------------------------------------------------- engine pieces


def _views(engine: Engine) -> List[ShardView]:
    """The engine's views (an engine without optimizer/strategy: ``contract.whole_views``)."""
    return list(engine.shard_views())


# --------------------------------------------------------------------------- save


def _rank_items(engine: Engine, views: List[ShardView], exclude_frozen: bool,
                client_tensors: Dict[str, torch.Tensor]) -> Tuple[List[TensorItem], Dict[str, Any]]:
    """The tensors this rank writes, and the per-parameter facts for its index."""
    inner = _inner_optimizer(engine)
    items: List[TensorItem] = []
    params: Dict[str, Any] = {}
    scalars: Dict[str, Any] = {}

    def add(kind: str, view: ShardView, tensor: torch.Tensor) -> None:
        info = {"param": view.name, "kind": kind, "start": view.start, "end": view.end}
        items.append(TensorItem(tensor_key(kind, view.name, view.start), tensor.dtype,
                                [view.numel], tensor, info))

    for view in views:
        frozen = view.master is None
        if frozen and exclude_frozen:
            continue
        params[view.name] = {"shape": list(view.global_shape), "dtype": dtype_to_str(view.weight.dtype),
                             "requires_grad": not frozen}
        if view.numel == 0:
            continue
        # An fp32 weight equals its master, so only the master is stored (half the bytes).
        if frozen or view.weight.dtype != torch.float32:
            add("weight", view, view.weight)
        if frozen:
            continue
        add("master", view, view.master)
        state = inner.state.get(view.master, {}) if inner is not None else {}
        scal = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == view.master.shape and value.dim() == 1:
                add(f"state.{key}", view, value)
            else:
                scal[key] = to_jsonable(value, f"optimizer state {key!r} of {view.name!r}")
        if scal:
            scalars[view.name] = scal
    if engine.global_rank == 0:
        for name, buf in _persistent_buffers(engine.module):
            info = {"param": name, "kind": "buffer", "start": 0, "end": buf.numel()}
            items.append(TensorItem(tensor_key("buffer", name, 0), buf.dtype, list(buf.shape), buf, info))
        for name, t in client_tensors.items():
            info = {"param": name, "kind": "client", "start": 0, "end": t.numel()}
            items.append(TensorItem(tensor_key("client", name, 0), t.dtype, list(t.shape), t, info))
    return items, {"params": params, "scalar_states": scalars}


def _split_client_state(client_state: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """Large top-level tensors go to safetensors, everything else to JSON."""
    tensors = {k: v.detach() for k, v in client_state.items()
               if torch.is_tensor(v) and v.numel() > 64}
    rest = {k: v for k, v in client_state.items() if k not in tensors}
    return to_jsonable(rest, "client_state"), tensors


def _write_rank_files(engine: Engine, staging: Path, items: List[TensorItem],
                      facts: Dict[str, Any], rng: Dict[str, Any], dataloader_state: Any) -> None:
    rank, world = engine.global_rank, engine.world_size
    stem = rank_file_stem(rank, world)
    record = write_safetensors(staging / f"{stem}.safetensors", items,
                               metadata={"format": "pt", "producer": FORMAT_NAME})
    _file_done()
    index = {"rank": rank, "world_size": world, "files": {f"{stem}.safetensors": record},
             "rng": to_jsonable(rng, "rng state"), "dataloader": dataloader_state, **facts}
    atomic_write_bytes(staging / f"{stem}.json", dumps_json(index))
    _file_done()


def _commit(engine: Engine, root: Path, staging: Path, tag: str,
            meta: Dict[str, Any], save_latest: bool) -> None:
    """Rank 0, after every rank wrote its files: metadata, rename, then ``latest``."""
    world = int(meta["world_size"])
    indexes = []
    params: Dict[str, Any] = {}
    for rank in range(world):
        name = f"{rank_file_stem(rank, world)}.json"
        raw = (staging / name).read_bytes()
        indexes.append({"file": name, "crc32": zlib.crc32(raw)})
        for pname, info in read_json(staging / name, "checkpoint index")["params"].items():
            params.setdefault(pname, info)
    meta["rank_indexes"] = indexes
    meta["params"] = params
    atomic_write_bytes(staging / META_FILE, dumps_json(meta))
    _file_done()
    final = root / tag
    old = None
    if final.exists():
        old = root / f".{tag}.old-{os.getpid()}"
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(root)
    if save_latest:
        atomic_write_text(root / LATEST_FILE, tag)
        _file_done()


def save_checkpoint(engine: Engine, save_dir: PathLike, tag: Optional[str] = None,
                    client_state: Optional[Dict[str, Any]] = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Save the engine's full training state under ``save_dir/tag`` (all ranks call this).

    ``tag`` defaults to ``global_step{N}``; ``latest`` names it once every rank is done.
    ``client_state`` values must be JSON-able or tensors (never pickled). With
    ``checkpoint.async_save`` the tensors are copied to CPU memory here and written in the
    background; the commit happens when the write is done (or at the next save/load).
    """
    _async.wait_pending(engine)
    tag = validate_tag(str(tag) if tag is not None else f"global_step{int(engine.global_steps)}")
    _check_tag_across_ranks(engine, tag)
    root = Path(save_dir)
    staging = root / f".{tag}.partial"
    rank = engine.global_rank
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():  # left by a save that was killed: never part of a valid tag
            shutil.rmtree(staging)
        staging.mkdir()
    _barrier(engine)

    client_json, client_tensors = _split_client_state(client_state or {})
    views = _views(engine)
    items, facts = _rank_items(engine, views, exclude_frozen_parameters, client_tensors)
    loader = engine.training_dataloader
    loader_state = (to_jsonable(loader.state_dict(), "training_dataloader.state_dict()")
                    if loader is not None and hasattr(loader, "state_dict") else None)
    rng = _rng_state()
    meta = _global_meta(engine, tag, client_json, exclude_frozen_parameters) if rank == 0 else None

    if _async.enabled(engine):
        _async.start(engine, _async.stage_items(items), lambda staged: _finish_save(
            engine, root, staging, tag, meta, save_latest, staged, facts, rng, loader_state,
            barrier=False))
        return True
    _finish_save(engine, root, staging, tag, meta, save_latest, items, facts, rng, loader_state,
                 barrier=True)
    return True


def _finish_save(engine: Engine, root: Path, staging: Path, tag: str,
                 meta: Optional[Dict[str, Any]], save_latest: bool, items: List[TensorItem],
                 facts: Dict[str, Any], rng: Dict[str, Any], loader_state: Any,
                 barrier: bool) -> None:
    _write_rank_files(engine, staging, items, facts, rng, loader_state)
    if barrier:
        _barrier(engine)
    else:  # background thread: no collectives here; wait for the other ranks' index files
        _async.wait_for_files(staging, [f"{rank_file_stem(r, engine.world_size)}.json"
                                        for r in range(engine.world_size)], active=meta is not None)
    if meta is not None:
        _commit(engine, root, staging, tag, meta, save_latest)
        log_dist(f"saved checkpoint {root / tag}", ranks=[0])
    if barrier:
        _barrier(engine)


def _global_meta(engine: Engine, tag: str, client_json: Any,
                 exclude_frozen: bool) -> Dict[str, Any]:
    from ..version import __version__
    inner = _inner_optimizer(engine)
    scaler = _loss_scaler(engine)
    sched = engine.lr_scheduler
    optimizer = None
    if inner is not None:
        groups = [{k: to_jsonable(v, f"optimizer param_groups[{i}][{k!r}]")
                   for k, v in g.items() if k != "params"} for i, g in enumerate(inner.param_groups)]
        optimizer = {"class": type(inner).__name__, "param_groups": groups}
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "shardwise_version": __version__, "torch_version": torch.__version__,
        "tag": tag, "world_size": engine.world_size, "zero_stage": _stage(engine),
        "counters": {"global_steps": int(engine.global_steps),
                     "global_samples": int(engine.global_samples),
                     "micro_steps": int(engine.micro_steps),
                     "skipped_steps": int(engine.skipped_steps),
                     "gradient_accumulation_steps": _grad_accum(engine)},
        "exclude_frozen_parameters": bool(exclude_frozen),
        "aliases": _aliases(engine.module),
        "buffers": {n: {"shape": list(b.shape), "dtype": dtype_to_str(b.dtype)}
                    for n, b in _persistent_buffers(engine.module)},
        "optimizer": optimizer,
        "loss_scaler": to_jsonable(scaler.state_dict(), "loss_scaler.state_dict()") if scaler else None,
        "lr_scheduler": (to_jsonable(sched.state_dict(), "lr_scheduler.state_dict()")
                         if sched is not None and hasattr(sched, "state_dict") else None),
        "client_state": client_json,
        "hf_config": _hf_config(engine.module),
        "config": _config_dict(engine),
    }


# --------------------------------------------------------------------------- load


def _check_model(engine: Engine, reader: CheckpointReader, views: List[ShardView],
                 strict: bool) -> None:
    """Raise a CheckpointError for a checkpoint that belongs to another model."""
    model = {n: p for n, p in engine.module.named_parameters()}
    stored = reader.params
    frozen_skipped = bool(reader.meta.get("exclude_frozen_parameters"))
    missing = [n for n, p in model.items() if n not in stored
               and not (frozen_skipped and not p.requires_grad)]
    unexpected = [n for n in stored if n not in model]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint {reader.path} does not match the model (load_module_strict=True): "
            f"{len(missing)} model parameters missing from it {missing[:5]}, {len(unexpected)} "
            f"unexpected ones in it {unexpected[:5]}. Load the checkpoint of this model, or pass "
            "load_module_strict=False to load the matching subset.")
    for view in views:
        info = stored.get(view.name)
        if info is not None and list(info["shape"]) != list(view.global_shape):
            raise CheckpointError(
                f"checkpoint {reader.path}: parameter {view.name!r} has shape {info['shape']} there "
                f"but {list(view.global_shape)} in the model; this checkpoint was written for a "
                "different model or configuration.")


def _view_reads(reader: CheckpointReader, view: ShardView, module_only: bool,
                with_states: bool) -> Dict[str, str]:
    """The stored kind that loading ``view`` reads for each of its roles, in load order:
    ``weight`` (the stored weight when its dtype matches or there is no master, else the
    master), ``master`` (the fp32 master, else the weight) and each ``state.*``."""
    has_master = reader.has("master", view.name)
    same_dtype = reader.params[view.name]["dtype"] == dtype_to_str(view.weight.dtype)
    reads = {"weight": "weight" if reader.has("weight", view.name) and (same_dtype or not has_master)
             else "master"}
    if module_only or view.master is None:
        return reads
    reads["master"] = "master" if has_master else "weight"
    if with_states:
        reads.update((kind, kind) for kind in reader.kinds(view.name) if kind.startswith("state."))
    return reads


def _load_views(engine: Engine, reader: CheckpointReader, views: List[ShardView], module_only: bool,
                load_optimizer: bool) -> None:
    inner = _inner_optimizer(engine)
    with_states = load_optimizer and inner is not None
    scalars: Dict[str, Dict[str, Any]] = {}
    for rank in range(reader.world_size):
        for name, scal in reader.rank_index(rank).get("scalar_states", {}).items():
            scalars.setdefault(name, scal)
    step_device = _step_device(inner)
    # Every read is known before the first one, so the reads run ahead on worker threads
    # (reader.read_ranges, bounded in memory) while this thread copies the previous tensors
    # to the device; reading, checksumming and copying then overlap instead of taking turns.
    # A kind serving two roles (the master as weight and as master) is read once.
    plan = [(view, _view_reads(reader, view, module_only, with_states)) for view in views
            if view.name in reader.params and view.numel > 0]
    requests = [(kind, view.name, view.start, view.end)
                for view, reads in plan for kind in dict.fromkeys(reads.values())]
    with torch.no_grad(), contextlib.closing(reader.read_ranges(requests)) as tensors:
        for view, reads in plan:
            got = {kind: next(tensors) for kind in dict.fromkeys(reads.values())}
            view.weight.copy_(got[reads["weight"]].to(view.weight.dtype))
            if "master" not in reads:
                continue
            view.master.copy_(got[reads["master"]].float())
            if not with_states:
                continue
            state: Dict[str, Any] = {}
            for role, kind in reads.items():
                if role.startswith("state."):
                    state[role[len("state."):]] = got[kind].to(view.master.device)
            for key, value in scalars.get(view.name, {}).items():
                value = from_jsonable(value)
                if torch.is_tensor(value) and key == "step":
                    value = value.to(step_device(view.master))
                state[key] = value
            if state:
                inner.state[view.master] = state
            else:
                inner.state.pop(view.master, None)


def _step_device(inner: Optional[torch.optim.Optimizer]):
    """Where the optimizer keeps its ``step`` tensors: torch puts them on the CPU unless the
    optimizer is fused or capturable, then next to the parameter. Match that."""
    defaults = getattr(inner, "defaults", {}) or {}
    on_param = bool(defaults.get("fused") or defaults.get("capturable"))
    return (lambda master: master.device) if on_param else (lambda master: torch.device("cpu"))


def _load_buffers(engine: Engine, reader: CheckpointReader, strict: bool) -> None:
    stored = reader.meta.get("buffers", {})
    mine = _persistent_buffers(engine.module)
    missing = [n for n, _ in mine if n not in stored]
    if strict and missing:
        raise CheckpointError(f"checkpoint {reader.path} lacks the model buffers {missing[:5]}; "
                              "it belongs to a different model (or pass load_module_strict=False).")
    with torch.no_grad():
        for name, buf in mine:
            if name not in stored:
                continue
            value = reader.read_whole("buffer", name)
            if list(value.shape) != list(buf.shape):
                raise CheckpointError(f"checkpoint {reader.path}: buffer {name!r} has shape "
                                      f"{list(value.shape)} there but {list(buf.shape)} in the model.")
            buf.copy_(value.to(buf.dtype))


def _load_optimizer_groups(engine: Engine, reader: CheckpointReader) -> None:
    inner = _inner_optimizer(engine)
    saved = reader.meta.get("optimizer")
    if inner is None or saved is None:
        return
    if saved["class"] != type(inner).__name__:
        raise CheckpointError(
            f"checkpoint {reader.path} holds {saved['class']} optimizer states but the engine "
            f"uses {type(inner).__name__}; pass load_optimizer_states=False to load the weights only.")
    groups = saved["param_groups"]
    if len(groups) != len(inner.param_groups):
        raise CheckpointError(
            f"checkpoint {reader.path} has {len(groups)} optimizer param groups but the engine has "
            f"{len(inner.param_groups)}; build the optimizer with the same groups, or pass "
            "load_optimizer_states=False.")
    for group, stored in zip(inner.param_groups, groups):
        for key, value in stored.items():
            value = from_jsonable(value)
            current = group.get(key)
            if torch.is_tensor(current) and not torch.is_tensor(value):
                current.fill_(value)
            else:
                group[key] = value


def load_checkpoint(engine: Engine, load_dir: PathLike, tag: Optional[str] = None,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    **_ignored: Any) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """Restore a checkpoint written by :func:`save_checkpoint` at any world size and stage.

    Returns ``(path, client_state)``, or ``(None, None)`` when ``tag`` is None and
    ``load_dir`` has no ``latest`` file (DeepSpeed's behaviour).
    """
    _async.wait_pending(engine)
    if resolve_tag(load_dir, tag) is None:
        logger.warning(f"no 'latest' file in {load_dir}; nothing loaded. Pass tag=... to load a "
                       "specific checkpoint.")
        return None, None
    with CheckpointReader(load_dir, tag) as reader:
        views = _views(engine)
        _check_model(engine, reader, views, load_module_strict)
        load_optimizer = load_optimizer_states and not load_module_only
        if load_optimizer:
            _load_optimizer_groups(engine, reader)
        _load_views(engine, reader, views, load_module_only, load_optimizer)
        _load_buffers(engine, reader, load_module_strict)
        engine.refresh_after_load(weights_only=load_module_only)
        client_state = reader.client_state()
        if not load_module_only:
            _restore_training_state(engine, reader, load_optimizer, load_lr_scheduler_states)
        path = str(reader.path)
    log_dist(f"loaded checkpoint {path} (written by {reader.world_size} ranks, ZeRO stage "
             f"{reader.meta.get('zero_stage')})", ranks=[0])
    return path, client_state


def _restore_training_state(engine: Engine, reader: CheckpointReader, load_optimizer: bool,
                            load_scheduler: bool) -> None:
    meta = reader.meta
    counters = dict(meta.get("counters", {}))
    saved_ga = counters.pop("gradient_accumulation_steps", None)
    for key, value in counters.items():
        if key in COUNTERS:
            setattr(engine, key, int(value))
    ga = _grad_accum(engine)
    if saved_ga and ga and saved_ga != ga:
        # The accumulation boundary is (micro_steps + 1) % GA == 0: with a new GA (e.g. a new
        # world size at a fixed batch) keep the boundary aligned by counting whole steps.
        engine.micro_steps = (int(counters.get("micro_steps", 0)) // saved_ga) * ga
    scaler = _loss_scaler(engine)
    if load_optimizer and scaler is not None and meta.get("loss_scaler") is not None:
        scaler.load_state_dict(from_jsonable(meta["loss_scaler"]))
    sched = engine.lr_scheduler
    if load_scheduler and sched is not None and meta.get("lr_scheduler") is not None:
        sched.load_state_dict(from_jsonable(meta["lr_scheduler"]))
    rank = engine.global_rank
    if rank < reader.world_size:
        index = reader.rank_index(rank)
        _set_rng_state(from_jsonable(index.get("rng") or {}))
        loader = engine.training_dataloader
        if loader is not None and hasattr(loader, "load_state_dict") and index.get("dataloader"):
            loader.load_state_dict(from_jsonable(index["dataloader"]))
    elif rank == reader.world_size:  # say it once, not once per extra rank
        logger.warning(f"checkpoint {reader.path} was written by {reader.world_size} ranks; ranks "
                       f">= {reader.world_size} keep their own RNG and data-loader position.")


# --------------------------------------------------------------------------- 16-bit export


def save_16bit_model(engine: Engine, save_dir: PathLike,
                     save_filename: str = "model.safetensors",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Write the module's compute-dtype weights (gathered under stage 3) to one file on rank 0.

    A ``.safetensors`` name gives safetensors (tied duplicates dropped, as Hugging Face
    expects); any other name (e.g. DeepSpeed's ``pytorch_model.bin``) gives a ``torch.save``
    of plain tensors, loadable with ``torch.load(..., weights_only=True)``. All ranks call it.
    """
    _async.wait_pending(engine)
    stage = _stage(engine)
    if stage == 3 and not engine.checkpoint_settings().gather_16bit_weights_on_model_save:
        logger.warning("save_16bit_model: ZeRO stage 3 with zero_optimization."
                       "gather_16bit_weights_on_model_save=false saves nothing (DeepSpeed's rule); "
                       "set it to true, or export a checkpoint with `shardwise convert`.")
        return False
    rank = engine.global_rank
    views = {v.name: v for v in _views(engine)}  # every rank lists every parameter
    state: Dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if exclude_frozen_parameters and not p.requires_grad:
            continue
        full = _gather_full(engine, name, p, views.get(name), stage)
        if rank == 0:
            state[name] = full
    if rank == 0:
        for name, buf in _persistent_buffers(engine.module):
            state[name] = buf.detach().cpu()
        _write_16bit(engine.module, Path(save_dir) / save_filename, state)
    _barrier(engine)
    return True


def _gather_full(engine: Engine, name: str, p: torch.nn.Parameter, view: Optional[ShardView],
                 stage: int) -> torch.Tensor:
    """The whole parameter on rank 0. Below stage 3 every rank holds it whole; under stage 3
    each rank contributes its owned slice to a sum (slices are disjoint, so the sum is exact)."""
    shape = torch.Size(view.global_shape) if view is not None else p.shape
    if stage < 3:
        return p.detach().to("cpu", copy=True)
    if not _dist_on(engine):  # one stage-3 rank owns everything, but p.data may be released
        if view is None or view.numel != shape.numel():
            raise CheckpointError(f"save_16bit_model: {name!r} is partitioned but no process group "
                                  "is initialised to gather it.")
        return view.weight.detach().to("cpu", copy=True).reshape(shape)
    dtype = view.weight.dtype if view is not None else p.dtype
    # gloo reduces fp32 reliably; a 16-bit value survives the fp32 round trip exactly.
    wire = torch.zeros(shape.numel(), dtype=torch.float32, device=engine.device)
    if view is not None and view.numel > 0:
        wire[view.start:view.end] = view.weight.float().to(engine.device)
    comm.reduce(wire, dst=global_rank(engine.dp_group, 0), group=engine.dp_group)
    return wire.to("cpu").to(dtype).reshape(shape)


def _write_16bit(module: torch.nn.Module, path: Path, state: Dict[str, torch.Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        dup = {n for names in _aliases(module).values() for n in names}
        items = [TensorItem(n, t.dtype, list(t.shape), t) for n, t in state.items() if n not in dup]
        write_safetensors(path, items, metadata={"format": "pt"})
        return
    aliases = _aliases(module)
    for first, others in aliases.items():
        for other in others:
            if first in state:
                state[other] = state[first]
    from .atomic import atomic_open
    with atomic_open(path) as f:
        torch.save(state, f)

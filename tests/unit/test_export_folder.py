"""The staging folder of ``shardwise convert``: swapped in whole, never mixed (issue 18, bug 4).

Directory renames are a platform seam (Windows refuses to rename onto an existing folder and
to rename a folder that is in use), so these small tests also run in the Windows subset.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardwise.checkpoint.export_folder import export_files, is_export_file, staged_export
from shardwise.errors import CheckpointError

pytestmark = pytest.mark.windows


def _export(target: Path, files: dict, overwrite: bool = False) -> None:
    with staged_export(target, overwrite) as stage:
        assert stage.parent == Path(os.path.abspath(target)).parent and ".tmp-" in stage.name
        for name, text in files.items():
            (stage / name).write_text(text)


def _tree(folder: Path) -> dict:
    return {p.name: p.read_text() for p in folder.iterdir()}


def _temps(folder: Path) -> list:
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name]


def test_new_folder_then_overwrite_keeps_only_user_files(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _export(out, {"model-00001-of-00002.safetensors": "a1", "model-00002-of-00002.safetensors":
                  "a2", "model.safetensors.index.json": "ia", "config.json": "ca"})
    (out / "tokenizer.json").write_text("tok")
    (out / "pytorch_model.bin").write_text("old bin")
    with pytest.raises(CheckpointError, match="already holds an export.*--overwrite"):
        _export(out, {"model.safetensors": "b"})
    assert _tree(out)["config.json"] == "ca"
    _export(out, {"model.safetensors": "b", "config.json": "cb"}, overwrite=True)
    assert _tree(out) == {"model.safetensors": "b", "config.json": "cb", "tokenizer.json": "tok"}
    assert _temps(tmp_path) == []


def test_folder_with_only_user_files_needs_no_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer_config.json").write_text("t")
    (out / "extras").mkdir()
    _export(out, {"model.safetensors": "m"})
    assert sorted(p.name for p in out.iterdir()) == ["extras", "model.safetensors",
                                                     "tokenizer_config.json"]


def test_error_inside_export_deletes_the_stage(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _export(out, {"model.safetensors": "a"})
    with pytest.raises(RuntimeError):
        with staged_export(out, overwrite=True) as stage:
            (stage / "model.safetensors").write_text("half")
            raise RuntimeError("interrupted")
    assert _tree(out) == {"model.safetensors": "a"} and _temps(tmp_path) == []


def test_current_directory_is_replaced_in_place(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "hf"
    _export(out, {"model-00001-of-00002.safetensors": "a", "config.json": "ca"})
    monkeypatch.chdir(out)
    _export(Path("."), {"model.safetensors": "b", "config.json": "cb"}, overwrite=True)
    assert Path.cwd().resolve() == out.resolve()
    assert _tree(out) == {"model.safetensors": "b", "config.json": "cb"}


def test_export_file_names() -> None:
    assert all(is_export_file(n) for n in ("model.safetensors", "config.json",
                                           "model-00003-of-00010.safetensors",
                                           "pytorch_model.bin", "model.safetensors.index.json"))
    assert not any(is_export_file(n) for n in ("tokenizer.json", "generation_config.json",
                                               "README.md", "special_tokens_map.json"))
    assert export_files(Path("/no/such/folder")) == []


def test_a_file_as_output_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a folder"):
        _export(target, {"model.safetensors": "m"})

"""``shardwise estimate`` on configs transformers cannot build: one line, no traceback (issue 18)."""
from __future__ import annotations

import json

from shardwise.profiling import estimate_cli


def _run(capsys, path):
    code = estimate_cli.main(["--model-config", str(path)])
    captured = capsys.readouterr()
    return code, captured.err.strip()


def test_unknown_model_type_is_one_line_with_close_names(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llamma", "hidden_size": 32}))
    code, err = _run(capsys, path)
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("shardwise estimate: model_type 'llamma'") and "'llama'" in err
    assert "pip install -U transformers" in err and "Traceback" not in err
    code, err = _run(capsys, tmp_path)  # the folder holding config.json
    assert code == 2 and err.count("\n") == 0 and "'llamma'" in err, err


def test_model_without_a_causal_lm_class_is_one_line(tmp_path, capsys):
    path = tmp_path / "vit.json"
    path.write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    code, err = _run(capsys, path)
    assert code == 2 and err.count("\n") == 0, err
    assert "cannot build a causal language model" in err and "'vit'" in err


def test_unreadable_json_is_one_line(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text("{model_type: llama")
    code, err = _run(capsys, path)
    assert code == 2 and err.count("\n") == 0 and "not a readable JSON config" in err, err

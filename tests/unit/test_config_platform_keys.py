"""The seed's Windows keys (examples/ds_config.json) off Windows: one info line, once, and no
effect (the engine does not empty the allocator cache); on Windows "aggressive" empties it
after every optimizer step."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

import shardwise
from shardwise.accelerator import get_accelerator
from shardwise.config import load_config, platform_keys
from shardwise.utils import logging as sw_logging
from tests.distributed._parity import engine_config, global_batches, make_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ds_config.json"


@pytest.fixture
def records(monkeypatch):
    """Records of the shardwise logger, with the log-once memories empty."""
    monkeypatch.setattr(sw_logging.info_once, "__defaults__", (set(),))
    monkeypatch.setattr(sw_logging.warn_once, "__defaults__", (set(),))
    got = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = got.append
    log = logging.getLogger("shardwise")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield got
    log.removeHandler(handler)
    log.setLevel(old_level)


def test_example_config_on_linux_logs_one_info_line_once(monkeypatch, records):
    monkeypatch.setattr(platform_keys, "current_system", lambda: "Linux")
    for _ in range(2):  # every run of a script loads the config again
        cfg = load_config(str(EXAMPLE))
        assert cfg.empty_cache_after_step is False
    windows = [r for r in records if "windows" in r.getMessage().lower()]
    assert [r.levelno for r in windows] == [logging.INFO]
    assert "Windows-only config keys ignored on Linux" in windows[0].getMessage()
    assert not [w for w in cfg.warnings if "windows" in w.lower()]


def test_example_config_on_windows_warns_what_each_key_does(monkeypatch, records):
    monkeypatch.setattr(platform_keys, "current_system", lambda: "Windows")
    cfg = load_config(str(EXAMPLE))
    assert cfg.empty_cache_after_step is True and cfg.infos == []
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any(m.startswith("windows_specific.enable") for m in warned)
    assert any(m.startswith("windows_specific.memory_optimization=\"aggressive\"") for m in warned)


@pytest.mark.parametrize("system, empties", [("Linux", 0), ("Darwin", 0), ("Windows", 2)])
def test_aggressive_memory_optimization_empties_the_cache_on_windows_only(monkeypatch, system,
                                                                          empties):
    monkeypatch.setattr(platform_keys, "current_system", lambda: system)
    calls = []
    monkeypatch.setattr(get_accelerator(), "empty_cache", lambda: calls.append(1))
    cfg = engine_config(stage=1, micro=2, ga=1, clip=0.0, lr=1e-2,
                        windows_specific={"enable": True, "memory_optimization": "aggressive"})
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    for x, y in global_batches(2, 2):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 2 and len(calls) == empties

"""The opt-in ``deepspeed`` import alias: ``import deepspeed`` resolves to shardwise.

Hugging Face ``transformers`` and ``accelerate`` decide whether DeepSpeed is present with
``importlib.util.find_spec("deepspeed")`` plus ``importlib.metadata.metadata("deepspeed")``,
and read its version with ``importlib.metadata.version("deepspeed")``. Both questions go
through ``sys.meta_path``, the documented extension point of the import system, so one
finder object answers them:

* ``find_spec("deepspeed[.x.y]")`` returns a spec whose loader hands back the shardwise
  module that implements that name (``deepspeed.zero`` is ``shardwise.zero``,
  ``deepspeed.utils`` is ``shardwise.integrations.deepspeed_api.utils`` ...). The module
  object is shared, never re-executed under a second name, so classes stay identical.
* ``find_distributions(name="deepspeed")`` yields a distribution whose METADATA names
  ``deepspeed`` with the API level shardwise follows (``DEEPSPEED_API_VERSION``) and a
  ``+shardwise`` local label, so version checks pass and ``pip``-style tools can tell.

Nothing is installed into site-packages and nothing happens until ``install()`` is called.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import importlib.metadata as metadata
import sys
import types
from typing import Dict, Iterator, Optional, Sequence

from ..errors import ShardwiseError
from ..version import __version__ as SHARDWISE_VERSION

DEEPSPEED_API_VERSION = "0.18.0"
"""The DeepSpeed release whose public API and config semantics shardwise follows."""

ALIAS_VERSION = f"{DEEPSPEED_API_VERSION}+shardwise.{SHARDWISE_VERSION}"
"""What ``importlib.metadata.version("deepspeed")`` and ``deepspeed.__version__`` report."""

_SURFACE = "shardwise.integrations.deepspeed_api"

# ``deepspeed.<name>`` served by an existing shardwise module instead of a surface module
_DIRECT: Dict[str, str] = {
    "deepspeed.zero": "shardwise.zero",
    "deepspeed.comm": "shardwise.comm",
    "deepspeed.checkpointing": "shardwise.activation",
    "deepspeed.runtime.activation_checkpointing.checkpointing": "shardwise.activation",
}


class AliasError(ShardwiseError, ImportError):
    """The deepspeed alias cannot be installed (real DeepSpeed already imported, or the
    Hugging Face modules were imported before the alias and cached "no DeepSpeed")."""


def target_of(fullname: str) -> str:
    """The shardwise module that implements ``deepspeed``-name ``fullname``."""
    if fullname in _DIRECT:
        return _DIRECT[fullname]
    return _SURFACE + fullname[len("deepspeed"):]


class _ExistingModuleLoader(importlib.abc.Loader):
    """Returns an already-imported module under the alias name, without re-executing it.

    The import system stamps the alias spec on the module it gets back; ``exec_module``
    puts the module's own spec back, so ``shardwise.zero.__spec__`` stays truthful."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own_spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if self._own_spec is not None:
            module.__spec__ = self._own_spec  # it ran once already, under its own name


class _AliasDistribution(metadata.Distribution):
    """Package metadata for the alias: ``Name: deepspeed``, ``Version: ALIAS_VERSION``."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {ALIAS_VERSION}\n"
                    f"Summary: shardwise {SHARDWISE_VERSION} serving the deepspeed API "
                    "(shardwise.integrations.use_as_deepspeed)\nAuthor: shardwise\n")
        if filename == "top_level.txt":
            return "deepspeed\n"
        return None

    def locate_file(self, path: "str | object") -> "object":
        import pathlib
        return pathlib.Path(importlib.import_module(_SURFACE).__file__).parent / str(path)


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """The ``sys.meta_path`` entry that makes ``deepspeed`` mean shardwise."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        real = target_of(fullname)
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None  # ``import deepspeed.x`` then fails as for any missing submodule
        is_package = found.submodule_search_locations is not None
        spec = importlib.machinery.ModuleSpec(fullname, _ExistingModuleLoader(real),
                                              is_package=is_package)
        if is_package:
            spec.submodule_search_locations = []  # submodules come through this finder too
        return spec

    def find_distributions(self, context: metadata.DistributionFinder.Context = metadata.DistributionFinder.Context()
                           ) -> Iterator[metadata.Distribution]:
        if context.name is None or context.name.lower().replace("_", "-") == "deepspeed":
            yield _AliasDistribution()


def _installed_finder() -> Optional[DeepSpeedAliasFinder]:
    for finder in sys.meta_path:
        if isinstance(finder, DeepSpeedAliasFinder):
            return finder
    return None


def is_installed() -> bool:
    """True while ``import deepspeed`` resolves to shardwise in this process."""
    return _installed_finder() is not None


def _check_hf_not_cached() -> None:
    """transformers picks HfDeepSpeedConfig's base class once, when its deepspeed module is
    first imported; imported before the alias it is a plain ``object`` and cannot work."""
    hf = sys.modules.get("transformers.integrations.deepspeed")
    if hf is not None and getattr(hf, "DeepSpeedConfig", None) is object:
        raise AliasError(
            "shardwise.integrations.use_as_deepspeed() was called after transformers' DeepSpeed "
            "integration was imported (it already decided that DeepSpeed is absent). Call "
            "use_as_deepspeed() first, at the top of the script, before importing "
            "transformers' Trainer, TrainingArguments or any model class.")


def install() -> DeepSpeedAliasFinder:
    """Put the alias finder first on ``sys.meta_path`` (idempotent)."""
    finder = _installed_finder()
    if finder is not None:
        return finder
    existing = sys.modules.get("deepspeed")
    if existing is not None and not getattr(existing, "__name__", "").startswith("shardwise"):
        raise AliasError("use_as_deepspeed(): the real `deepspeed` package is already imported "
                         f"({getattr(existing, '__file__', existing)!r}); call use_as_deepspeed() "
                         "before anything imports deepspeed, or use DeepSpeed itself.")
    _check_hf_not_cached()
    finder = DeepSpeedAliasFinder()
    sys.meta_path.insert(0, finder)
    importlib.invalidate_caches()
    return finder


def uninstall() -> None:
    """Remove the finder and every ``deepspeed`` entry it put in ``sys.modules`` (tests)."""
    finder = _installed_finder()
    if finder is None:
        return
    while finder is not None:
        sys.meta_path.remove(finder)
        finder = _installed_finder()
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]
    importlib.invalidate_caches()

"""Which modules of a package run compiled (mypyc), and keeping a build older than its source from running.

``scripts/setup.sh`` compiles a few pure, synchronous, typed modules with mypyc (part
of the pinned mypy) into C extensions next to their sources, and writes a stamp file,
``mypyc.stamp``, beside them: one ``sha256  NAME.py`` line per module compiled (the
format of ``sha256sum``).  The ``.py`` file stays the single source of truth; the
extension is an implementation detail that only makes it faster.

Python imports an extension module before a source module of the same name, so a
build older than an edited source would silently run old code.  :func:`guard`, called
by a package's ``__init__`` before any of its modules is imported, puts a finder first
on ``sys.meta_path`` that answers for such modules with their source instead.  Without
any build (a source tree nobody ran ``scripts/setup.sh`` in) the sources run: slower,
otherwise the same, and without a word — a missing build is not an error.  What each
module runs as is in :data:`STATES`; a test holds the installed tree to ``compiled``.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

STAMP_NAME: Final = "mypyc.stamp"
COMPILED: Final = "compiled"
#: no extension next to the source: the source runs
NOT_BUILT: Final = "source (not compiled: scripts/setup.sh builds it)"
#: an extension built from another version of the source: the source runs
STALE: Final = "source (the compiled build is older than the source: run scripts/setup.sh)"

#: full module name -> COMPILED, NOT_BUILT or STALE, for every module a package guards
STATES: dict[str, str] = {}


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Finds the listed modules as their ``.py`` sources, passing over extensions built from older sources."""

    def __init__(self) -> None:
        self.sources: dict[str, Path] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        source = self.sources.get(fullname)
        return None if source is None else importlib.util.spec_from_file_location(fullname, source)


_FINDER: Final = _SourceFirst()


def _stamped(directory: Path) -> dict[str, str]:
    """``mypyc.stamp``'s hashes by file name (empty when there is none)."""
    try:
        lines = (directory / STAMP_NAME).read_text().splitlines()
    except OSError:
        return {}
    return {name.strip().lstrip("*"): digest for digest, _, name in (line.partition(" ") for line in lines)}


def guard(package: str, directory: Path, modules: Sequence[str]) -> None:
    """Record what each of ``modules`` (short names in ``package``, whose files are in ``directory``) runs as.

    Must run before any of them is imported: a stale build is passed over then.
    """
    stamped = _stamped(directory)
    for name in modules:
        source = directory / f"{name}.py"
        built = any((directory / f"{name}{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)
        state = NOT_BUILT
        if built:
            state = COMPILED if stamped.get(source.name) == hashlib.sha256(source.read_bytes()).hexdigest() else STALE
        STATES[f"{package}.{name}"] = state
        if state == STALE:
            _FINDER.sources[f"{package}.{name}"] = source
    if _FINDER.sources and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def states_of(package: str) -> dict[str, str]:
    """:data:`STATES` of the modules ``package`` guards (other packages' are in it too)."""
    return {name: state for name, state in STATES.items() if name.startswith(f"{package}.")}


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from a compiled extension (not from its source)."""
    return isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader)


__all__ = ["COMPILED", "NOT_BUILT", "STALE", "STAMP_NAME", "STATES", "guard", "is_compiled", "states_of"]

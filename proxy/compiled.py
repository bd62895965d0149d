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

The modules of the relay's lane (:data:`RELAY_LANE`) are compiled together into one
extension, so their calls to one another are C calls: they run compiled together or
from source together (:class:`Group`).
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
from typing import Final, NamedTuple

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


class Group(NamedTuple):
    """Modules compiled into one extension (``scripts/setup.sh``'s ``mypyc_group``).

    A call from one of them to another is a C call (no arguments parsed, no Python frame);
    the price is that they run compiled together or not at all: a member compiled from
    other sources than the one beside it would call the group's old copy of the others, so
    one stale or missing member runs every member from its source.
    """

    #: the dotted name of its shared library, less ``__mypyc`` (beside the package it names)
    name: str
    #: every member's full module name
    modules: tuple[str, ...]


#: What runs per relayed read: the reactor's hop and its socket calls, the pipeline, the header
#: scanner and its walk of the plain command forms (one extension: see :class:`Group`).
RELAY_LANE: Final = Group("proxy.relay_lane", ("proxy.server.hop", "proxy.server.plain_socket", "proxy.core.pipeline",
                                               "proxy.core.scanner", "proxy.protocol.plain_forms"))
#: What telemetry runs per message: the walk of the SENDs and receipts it accounts in bulk and the latency
#: histogram's recording (one extension: one package's modules share its one ``mypyc.stamp``).
TELEMETRY_LANE: Final = Group("proxy.telemetry.message_lane", ("proxy.telemetry.bulk_forms",
                                                                 "proxy.telemetry.histogram_cells"))


def _built(path: Path) -> bool:
    """Whether an extension of the module whose source is ``path`` (less ``.py``) is beside it."""
    return any(path.with_name(path.name + suffix).exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _state_of(source: Path) -> str:
    """What the module whose source is ``source`` runs as, judged by itself."""
    if not _built(source.with_suffix("")):
        return NOT_BUILT
    stamped = _stamped(source.parent).get(source.name)
    return COMPILED if stamped == hashlib.sha256(source.read_bytes()).hexdigest() else STALE


def _group_states(group: Group, package: str, directory: Path) -> dict[str, str]:
    """Each member's state: COMPILED only when every member and the shared library are (see :class:`Group`)."""
    depth = package.count(".")
    top = directory if depth == 0 else directory.parents[depth - 1]
    sources = {name: top.joinpath(*name.split(".")[1:]).with_suffix(".py") for name in group.modules}
    own = {name: _state_of(source) for name, source in sources.items()}
    whole = set(own.values()) == {COMPILED} and _built(top.joinpath(*f"{group.name}__mypyc".split(".")[1:]))
    state = COMPILED if whole else STALE if STALE in own.values() else NOT_BUILT
    if not whole:
        for name, source in sources.items():
            if own[name] != NOT_BUILT:  # (an extension is there: pass it over)
                _FINDER.sources[name] = source
    return dict.fromkeys(group.modules, state)


def guard(package: str, directory: Path, modules: Sequence[str], group: Group | None = None) -> None:
    """Record what each of ``modules`` (short names in ``package``, whose files are in ``directory``) runs as.

    Those in ``group`` run as the whole group does.  Must run before any of them is imported:
    a stale build is passed over then.
    """
    group_states = _group_states(group, package, directory) if group is not None else {}
    for name in modules:
        full = f"{package}.{name}"
        state = group_states.get(full) or _state_of(directory / f"{name}.py")
        STATES[full] = state
        if state == STALE and full not in group_states:
            _FINDER.sources[full] = directory / f"{name}.py"
    if _FINDER.sources and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def states_of(package: str) -> dict[str, str]:
    """:data:`STATES` of the modules ``package`` guards (other packages' are in it too)."""
    return {name: state for name, state in STATES.items() if name.startswith(f"{package}.")}


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from a compiled extension (not from its source)."""
    return isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader)


__all__ = ["COMPILED", "NOT_BUILT", "RELAY_LANE", "STALE", "STAMP_NAME", "STATES", "TELEMETRY_LANE", "Group", "guard",
           "is_compiled", "states_of"]

"""Modules run compiled (mypyc) where scripts/setup.sh installed them, and their source otherwise.

A broken build must not fall back to the (slower) source silently: the installed tree
is held to its compiled modules here (the analytics decoder; the relay's lane, one extension: the reactor's hop, its
socket calls, the pipeline, the header scanner and its walk of the plain command forms; the draws of sampled rules;
telemetry's lane, one extension: its walk of the SENDs and receipts it accounts in bulk and the latency histogram's
record).
The source runs instead of a build older than itself, and without any build; one stale member of the lane runs
the whole lane from source.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType

import pytest

import proxy.analytics
import proxy.core
import proxy.protocol
import proxy.rules
import proxy.server
import proxy.telemetry
from proxy import compiled
from proxy.analytics import decode


@pytest.mark.parametrize("package", [proxy.analytics, proxy.core, proxy.protocol, proxy.rules, proxy.server,
                                     proxy.telemetry],
                         ids=lambda package: package.__name__)
def test_the_installed_tree_runs_every_listed_module_compiled(package: ModuleType) -> None:
    """scripts/setup.sh built each module and it is current; were it not, this names what to run."""
    assert package.COMPILED_MODULES
    # (every package is imported by now: each package's states are its own modules' only)
    assert compiled.states_of(package.__name__) == {f"{package.__name__}.{name}": compiled.COMPILED
                                                     for name in package.COMPILED_MODULES}
    for name in package.COMPILED_MODULES:
        module = importlib.import_module(f"{package.__name__}.{name}")
        assert compiled.STATES[module.__name__] == compiled.COMPILED, compiled.STATES
        assert compiled.is_compiled(module), module.__file__
    assert decode._READ_WIRE


def _package(tmp_path: Path, name: str, *, extension: bool, stamp: str | None) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "__init__.py").write_text(
        "from pathlib import Path\nfrom proxy import compiled\n"
        "compiled.guard(__name__, Path(__file__).parent, ['kernel'])\n")
    (directory / "kernel.py").write_text("WHERE = 'source'\n")
    if extension:  # not loadable: importing it instead of the source would fail the test
        (directory / f"kernel{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not an extension")
    if stamp is not None:
        (directory / compiled.STAMP_NAME).write_text(stamp)
    return directory


def test_a_build_older_than_its_source_is_passed_over_and_a_missing_build_is_no_error(tmp_path: Path) -> None:
    sys.path.insert(0, str(tmp_path))
    try:
        _package(tmp_path, "stale_build", extension=True, stamp="0" * 64 + "  kernel.py\n")
        _package(tmp_path, "no_build", extension=False, stamp=None)
        _package(tmp_path, "unstamped_build", extension=True, stamp=None)
        for package, state in (("stale_build", compiled.STALE), ("no_build", compiled.NOT_BUILT),
                               ("unstamped_build", compiled.STALE)):
            kernel = importlib.import_module(f"{package}.kernel")
            assert kernel.WHERE == "source"
            assert compiled.STATES[f"{package}.kernel"] == state
            assert not compiled.is_compiled(kernel)
    finally:
        sys.path.remove(str(tmp_path))
        for package in ("stale_build", "no_build", "unstamped_build"):
            sys.modules.pop(f"{package}.kernel", None)
            sys.modules.pop(package, None)


def test_a_group_runs_compiled_only_whole_and_one_stale_member_runs_every_member_from_source(tmp_path: Path) -> None:
    """The relay's lane is one extension: a member built from other sources, or a missing shared library,
    would have the others call the group's old copy of it, so every member then runs its source."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    top = tmp_path / "lane_top"
    group = compiled.Group("lane_top.lane", ("lane_top.fresh.kernel", "lane_top.stale.kernel"))
    (top / "fresh").mkdir(parents=True)
    (top / "stale").mkdir()
    (top / "__init__.py").write_text("")
    for name in ("fresh", "stale"):
        directory = top / name
        (directory / "__init__.py").write_text(
            "from pathlib import Path\nfrom proxy import compiled\n"
            f"GROUP = compiled.Group({group.name!r}, {group.modules!r})\n"
            "compiled.guard(__name__, Path(__file__).parent, ['kernel'], GROUP)\n")
        (directory / "kernel.py").write_text(f"WHERE = 'source of {name}'\n")
        # not loadable: importing either instead of its source would fail the test
        (directory / f"kernel{suffix}").write_bytes(b"not an extension")
    (top / f"lane__mypyc{suffix}").write_bytes(b"not a library")
    fresh_digest = hashlib.sha256((top / "fresh" / "kernel.py").read_bytes()).hexdigest()
    (top / "fresh" / compiled.STAMP_NAME).write_text(f"{fresh_digest}  kernel.py\n")
    (top / "stale" / compiled.STAMP_NAME).write_text("0" * 64 + "  kernel.py\n")
    sys.path.insert(0, str(tmp_path))
    try:
        for name in ("fresh", "stale"):
            kernel = importlib.import_module(f"lane_top.{name}.kernel")
            assert f"source of {name}" == kernel.WHERE
            assert compiled.STATES[f"lane_top.{name}.kernel"] == compiled.STALE
            assert not compiled.is_compiled(kernel)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name.startswith("lane_top")]:
            del sys.modules[name]


@pytest.mark.parametrize("lane", [compiled.RELAY_LANE, compiled.TELEMETRY_LANE], ids=lambda lane: lane.name)
def test_each_lane_is_one_group_and_its_members_are_listed_as_compiled(lane: compiled.Group) -> None:
    """Every member of the lane is in its package's COMPILED_MODULES (held to compiled above), and the
    shared library is where the shims look for it."""
    listed = {f"{package.__name__}.{name}" for package in (proxy.core, proxy.protocol, proxy.server, proxy.telemetry)
              for name in package.COMPILED_MODULES}
    assert set(lane.modules) <= listed
    library = importlib.import_module(f"{lane.name}__mypyc")
    assert compiled.is_compiled(library)
    for name in lane.modules:
        assert compiled.STATES[name] == compiled.COMPILED

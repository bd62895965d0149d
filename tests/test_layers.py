"""Trio only at the edge, pytest only in the plugin: every module under ``proxy/`` is read with ``ast``.

The Trio edge is the list below: the modules that own sockets, tasks and timers.
Everything else — codec, session, pipeline, rules, recording writer, replay logic,
telemetry, analytics, config — imports no trio, directly or through an edge module, so
it runs (and is tested) with no event loop, and time reaches it only as ``now``.  The
README's "The Trio edge" names the same list.  Product code imports no pytest either,
except the pytest plugin the distribution registers (SPEC: "Test-suite integration").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "proxy"

#: whole packages that are Trio (every module in them may import trio)
EDGE_PACKAGES = frozenset({
    "proxy.server",      # the proxy: listeners, relays, upstreams, observers' task, recorder task, rule watcher
    "proxy.cli",         # the commands: each runs its own Trio loop
    "proxy.testing",     # the test-suite API: proxies, clusters and replay servers on threads, async fault blocks
})
#: single Trio modules (and packages' ``__init__`` re-exporting them) in packages otherwise sans-IO
EDGE_MODULES = frozenset({
    "proxy.__main__",                 # runs the CLI
    "proxy.containment",              # turns a connection's peer loss (Trio's errors) into one log line
    "proxy.pytest_plugin",            # the pytest plugin: fixtures around proxy.testing
    "proxy.admin.serve",              # hypercorn on Trio for the admin API
    "proxy.broker",                   # the embedded broker's API: clusters on threads (from embedded)
    "proxy.broker.admin",             # the embedded broker's admin REST API on hypercorn
    "proxy.broker.embedded",          # embedded clusters on threads of their own
    "proxy.broker.replicator",        # geo-replication through the built-in client
    "proxy.broker.server",            # the embedded broker's listeners and connections
    "proxy.client",                   # the built-in client's API (from client, producer, consumer)
    "proxy.client.client",            # the built-in client: connections, lookups, producers, consumers
    "proxy.client.connection",
    "proxy.client.consumer",
    "proxy.client.lookup",
    "proxy.client.producer",
    "proxy.client.reader",
    "proxy.client.receipt",
    "proxy.client.reconnecting",
    "proxy.replay.forward",           # --unmatched forward over the client's connections
    "proxy.replay.replayer",          # client-side replay against a live broker
    "proxy.replay.server",            # replay --serve
})
#: the only product module that may import pytest
PYTEST_MODULES = frozenset({"proxy.pytest_plugin"})

_TRIO = "trio"
_PYTEST = frozenset({"pytest", "_pytest", "pytest_trio"})


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def in_edge(module: str) -> bool:
    return module in EDGE_MODULES or any(module == p or module.startswith(p + ".") for p in EDGE_PACKAGES)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module ``source`` imports, anywhere in it (functions and TYPE_CHECKING blocks too), absolute."""
    imported: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            imported.add(base)
            imported.update(f"{base}.{alias.name}" for alias in node.names)  # ``from pkg import module``
    return imported


def violations(module: str, imported: set[str], product_modules: set[str]) -> list[str]:
    """What ``module`` may not import: trio outside the edge, edge modules from outside it, pytest."""
    found = []
    for name in sorted(imported):
        parts = name.split(".")
        if not in_edge(module):
            if _TRIO in parts:
                found.append(f"{module} imports {name} (trio outside the edge)")
            elif name in product_modules and in_edge(name):
                found.append(f"{module} imports {name} (a Trio edge module, from outside the edge)")
        if parts[0] in _PYTEST and module not in PYTEST_MODULES:
            found.append(f"{module} imports {name} (pytest in product code)")
    return found


def product_sources() -> dict[str, tuple[Path, bool]]:
    return {module_name(path): (path, path.name == "__init__.py") for path in sorted(PACKAGE.rglob("*.py"))
            if "pb" not in path.relative_to(PACKAGE).parts[:1]}


def test_no_module_outside_the_trio_edge_imports_trio_or_an_edge_module_and_only_the_plugin_imports_pytest(
        ) -> None:
    sources = product_sources()
    assert len(sources) > 150  # the walk found the package
    found: list[str] = []
    for module, (path, is_package) in sources.items():
        found += violations(module, imported_modules(path.read_text(encoding="utf-8"), module, is_package),
                            set(sources))
    assert found == []


def test_every_entry_of_the_edge_exists_and_the_readme_names_it() -> None:
    """A stale entry would silently widen the edge; the README's list is the documented one."""
    sources = product_sources()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for entry in sorted(EDGE_MODULES | EDGE_PACKAGES):
        assert entry in sources, f"{entry} is listed in the edge but does not exist"
        assert f"`{entry}`" in readme, f"README.md does not name {entry} in the Trio edge"


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("proxy.rules.engine", "import trio\n", ["proxy.rules.engine imports trio (trio outside the edge)"]),
    ("proxy.rules.engine", "def later():\n    from trio.lowlevel import checkpoint\n",
     ["proxy.rules.engine imports trio.lowlevel (trio outside the edge)",
      "proxy.rules.engine imports trio.lowlevel.checkpoint (trio outside the edge)"]),
    ("proxy.recording", "from proxy.server.recorder import Recorder\n",
     ["proxy.recording imports proxy.server.recorder (a Trio edge module, from outside the edge)"]),
    ("proxy.rules.reload", "from ..server import rule_watch\n",
     ["proxy.rules.reload imports proxy.server (a Trio edge module, from outside the edge)",
      "proxy.rules.reload imports proxy.server.rule_watch (a Trio edge module, from outside the edge)"]),
    ("proxy.testing.tap", "import pytest\n", ["proxy.testing.tap imports pytest (pytest in product code)"]),
    ("proxy.server.relay", "import trio\nfrom proxy.server import reactor\n", []),
    ("proxy.pytest_plugin", "import pytest\nimport trio\n", []),
    ("proxy.client.batching", "import trio\n", ["proxy.client.batching imports trio (trio outside the edge)"]),
])
def test_the_check_sees_trio_edge_and_pytest_imports_wherever_they_are_written(
        module: str, source: str, expected: list[str]) -> None:
    is_package = module == "proxy.recording"
    sources = set(product_sources())
    assert violations(module, imported_modules(source, module, is_package), sources) == expected


def test_the_sans_io_layers_load_with_no_trio_at_all() -> None:
    """What the import statements say holds at run time: no sans-IO package pulls trio in indirectly."""
    import subprocess
    import sys

    layers = ["proxy.protocol.session", "proxy.core.pipeline", "proxy.rules.engine", "proxy.rules.reload",
              "proxy.rules.hook", "proxy.recording.writer", "proxy.recording.observer", "proxy.recording.reader",
              "proxy.replay.client_side", "proxy.replay.routes", "proxy.replay.served", "proxy.telemetry",
              "proxy.admin.app", "proxy.config.proxy_config", "proxy.analytics.decode"]
    code = (f"import sys, {', '.join(layers)}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'pytest', '_pytest')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"

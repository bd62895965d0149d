"""Fixtures of the real-peer tests: the real Apache Pulsar broker and the embedded broker, once per session
(once per pytest-xdist worker: ``bash scripts/test.sh`` runs two).

``real_pulsar`` starts ``PulsarStandaloneStarter`` (tests/peers/real_pulsar.py) once per
test session, with a plaintext port and a TLS port whose certificate (for 127.0.0.1,
signed by a CA made here with trustme) it writes into the session's temporary
directory, and stops it by PID when the session ends.  ``embedded_pulsar`` does the same
for ``pulsar-tap broker`` (two brokers, so lookups answer Redirect).  Both are given to
tests as :class:`peers_rig.Upstream`, so a test is written once for either.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest
from peers_rig import Upstream, embedded_running, upstream_of
from real_pulsar import Standalone, make_tls_files, start_standalone

WORKER_LINES = "pulsar_tap_report_lines"  # the key tests/conftest.py reads; a list of lines


def _report(config: pytest.Config, line: str) -> None:
    """A line in the test run's own output (not captured): what the real broker costs, in every CI log.

    In a worker of pytest-xdist (``bash scripts/test.sh`` runs two) the line goes to the controller with the
    worker's output and is written when the worker is done (tests/conftest.py ``pytest_testnodedown``).
    """
    output = getattr(config, "workeroutput", None)
    if output is not None:
        output.setdefault(WORKER_LINES, []).append(line.strip())
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line, file=sys.stderr)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


@pytest.fixture(scope="session")
def real_pulsar(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[Standalone]:
    """The real Apache Pulsar standalone: ``.service_url``, ``.service_url_tls``, ``.admin_url``, ``.tls``, ``.pid``."""
    workdir = tmp_path_factory.mktemp("pulsar-standalone")
    broker = start_standalone(workdir, tls=make_tls_files(workdir))
    _report(pytestconfig, f"\nreal Pulsar standalone ready in {broker.startup_seconds:.1f} s "
                          f"(pid {broker.pid}, {broker.service_url}, log {broker.log_file})")
    try:
        yield broker
    finally:
        started = time.monotonic()
        broker.stop()
        _report(pytestconfig, f"real Pulsar standalone stopped in {time.monotonic() - started:.1f} s")


@pytest.fixture(scope="session")
def real_upstream(real_pulsar: Standalone) -> Upstream:
    """The real standalone as an :class:`peers_rig.Upstream`."""
    return upstream_of(real_pulsar)


@pytest.fixture(scope="session")
def embedded_pulsar() -> Iterator[Upstream]:
    """``pulsar-tap broker --brokers 2 --admin ...`` in a subprocess, for the whole session."""
    with embedded_running(brokers=2) as upstream:
        yield upstream


@pytest.fixture
def upstream(request: pytest.FixtureRequest) -> Upstream:
    """The upstream a parametrized test names: ``real`` or ``embedded`` (``indirect=["upstream"]``)."""
    name = request.param
    fixture = {"real": "real_upstream", "embedded": "embedded_pulsar"}[name]
    value: Upstream = request.getfixturevalue(fixture)
    return value

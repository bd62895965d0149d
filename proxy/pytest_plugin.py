"""The pytest plugin of pulsar-tap (entry point ``pytest11``, name ``pulsar_tap``): brokers, taps, cassettes.

Fixtures (each starts something only when a test asks for it):

- ``pulsar_cluster`` — an embedded cluster (:class:`~proxy.testing.cluster.EmbeddedCluster`),
  kept for the whole session: one per distinct size, ``--pulsar-brokers N``
  (default 1) or ``@pytest.mark.pulsar_cluster(brokers=3, partitions=4)``;
- ``pulsar_upstream`` — the service URL the taps front: ``--pulsar-url URL`` (or
  the ``pulsar_url`` ini value) when given, else ``pulsar_cluster``'s.  Override it
  in a conftest to point the taps at another broker (one fixture, one line);
- ``pulsar_tap`` — a :class:`~proxy.testing.tap.Tap` in front of ``pulsar_upstream``,
  shared by the session, its rules removed after every test; with
  ``@pytest.mark.pulsar_cassette`` a tap of the test's own in front of its cassette
  (``--pulsar-tap-process`` runs taps in child processes);
- ``pulsar_cassette`` — the test's :class:`~proxy.testing.cassette.CassetteSession`
  (``.replaying``, ``.plan``), or None without the marker.

Cassettes: ``@pytest.mark.pulsar_cassette("name", record_mode=None)`` keeps the
test's broker traffic in ``cassettes/NAME/`` beside the test file (default name:
``MODULE/TEST``); the record mode — ``--pulsar-record-mode once|new_episodes|none|all``
(VCR.py's modes; the command line wins over the marker's ``record_mode``, which wins
over the ini value ``pulsar_record_mode``, default ``once``) — decides between recording
against the upstream and replaying broker-side with no broker.  A cassette is
written only when the test passes; a replayed test whose requests the cassette
could not answer fails with that count.

This is the only module of the package that imports pytest; it imports nothing
else of the package until a fixture runs, so loading it costs the suites that do
not use it nothing.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from proxy.testing.cassette import CassetteSession
    from proxy.testing.cluster import EmbeddedCluster
    from proxy.testing.tap import Tap

_PASSED = pytest.StashKey[bool]()
_CASSETTE = pytest.StashKey["CassetteSession"]()
_RECORD_MODE_CHOICES = ("once", "new_episodes", "new", "none", "all")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pulsar-tap", "pulsar-tap fixtures (pulsar_cluster, pulsar_tap, cassettes)")
    group.addoption("--pulsar-url", metavar="URL", default=None,
                    help="the broker pulsar_tap fronts and cassettes record against (default: an embedded cluster)")
    group.addoption("--pulsar-brokers", metavar="N", type=int, default=None,
                    help="brokers of the embedded pulsar_cluster (default 1; marker pulsar_cluster(brokers=N))")
    group.addoption("--pulsar-record-mode", choices=_RECORD_MODE_CHOICES, default=None,
                    help="cassettes: once (default), new_episodes, none or all, as VCR.py")
    group.addoption("--pulsar-tap-process", action="store_true", default=False,
                    help="run pulsar_tap's proxies in child processes instead of threads")
    parser.addini("pulsar_url", "default for --pulsar-url", default="")
    parser.addini("pulsar_record_mode", "default for --pulsar-record-mode", default="once")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pulsar_cluster(brokers=1, partitions=0): the size of the embedded "
                                       "cluster pulsar_cluster gives this test (pulsar-tap)")
    config.addinivalue_line("markers", "pulsar_cassette(name=None, record_mode=None): record this test's broker "
                                       "traffic once, replay it broker-side afterwards (pulsar-tap)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if report.when == "call" and item.get_closest_marker("pulsar_cassette") is not None:
        item.stash[_PASSED] = report.passed
    return report


class _Pool:
    """What the session shares: embedded clusters by size, taps by upstream."""

    def __init__(self, process: bool) -> None:
        self.process = process
        self.clusters: dict[tuple[int, int], EmbeddedCluster] = {}
        self.taps: dict[str, Tap] = {}

    def cluster(self, brokers: int, partitions: int) -> EmbeddedCluster:
        from proxy.testing.cluster import EmbeddedCluster

        key = (brokers, partitions)
        if key not in self.clusters:
            self.clusters[key] = EmbeddedCluster(brokers, partitions=partitions).start()
        return self.clusters[key]

    def tap(self, upstream: str) -> Tap:
        from proxy.testing.tap import Tap

        tap = self.taps.get(upstream)
        if tap is None or not tap.running:  # (a test may have closed the shared tap)
            tap = self.taps[upstream] = Tap(upstream, process=self.process).start()
        return tap

    def close(self) -> None:
        for tap in self.taps.values():
            tap.close()
        for cluster in self.clusters.values():
            cluster.stop()


@pytest.fixture(scope="session")
def _pulsar_tap_pool(pytestconfig: pytest.Config) -> Iterator[_Pool]:
    pool = _Pool(bool(pytestconfig.getoption("pulsar_tap_process")))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def pulsar_cluster(request: pytest.FixtureRequest, _pulsar_tap_pool: _Pool) -> EmbeddedCluster:
    """An embedded cluster, kept for the session (size: marker ``pulsar_cluster``, else ``--pulsar-brokers``)."""
    brokers = request.config.getoption("pulsar_brokers") or 1
    partitions = 0
    marker = request.node.get_closest_marker("pulsar_cluster")
    if marker is not None:
        brokers = int(marker.kwargs.get("brokers", marker.args[0] if marker.args else brokers))
        partitions = int(marker.kwargs.get("partitions", 0))
    if brokers < 1 or partitions < 0:
        raise pytest.UsageError(f"pulsar_cluster: brokers must be >= 1 and partitions >= 0 ({request.node.nodeid})")
    return _pulsar_tap_pool.cluster(brokers, partitions)


@pytest.fixture
def pulsar_upstream(request: pytest.FixtureRequest) -> str:
    """The service URL taps front: ``--pulsar-url`` / ini ``pulsar_url``, else the embedded ``pulsar_cluster``."""
    url = request.config.getoption("pulsar_url") or str(request.config.getini("pulsar_url") or "")
    if url:
        return url
    cluster: EmbeddedCluster = request.getfixturevalue("pulsar_cluster")
    return cluster.service_url


@pytest.fixture
def pulsar_tap(request: pytest.FixtureRequest, _pulsar_tap_pool: _Pool) -> Iterator[Tap]:
    """A tap in front of ``pulsar_upstream`` (rules removed after the test), or of the test's cassette."""
    marker = request.node.get_closest_marker("pulsar_cassette")
    if marker is None:
        tap = _pulsar_tap_pool.tap(request.getfixturevalue("pulsar_upstream"))
        try:
            yield tap
        finally:
            if tap.running:
                tap.reset()
        return
    yield from _cassette_tap(request, marker, _pulsar_tap_pool)


@pytest.fixture
def pulsar_cassette(request: pytest.FixtureRequest, pulsar_tap: Tap) -> CassetteSession | None:
    """The test's cassette session (``.replaying``, ``.plan``, ``.cassette.path``), None without the marker."""
    session: CassetteSession | None = request.node.stash.get(_CASSETTE, None)
    return session


def _cassette_tap(request: pytest.FixtureRequest, marker: pytest.Mark, pool: _Pool) -> Iterator[Tap]:
    from proxy.testing.cassette import Cassette, CassetteMissing, record_mode
    from proxy.testing.tap import Tap

    # the command line wins (so one flag re-records everything), then the marker, then the ini value
    mode_name = (request.config.getoption("pulsar_record_mode") or marker.kwargs.get("record_mode")
                 or str(request.config.getini("pulsar_record_mode") or "once"))
    try:
        mode = record_mode(mode_name)
    except ValueError as exc:
        raise pytest.UsageError(f"{request.node.nodeid}: {exc}") from None
    cassette = Cassette(_cassette_path(request, marker), mode)
    try:
        session = cassette.open(lambda: str(request.getfixturevalue("pulsar_upstream")))
    except CassetteMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    request.node.stash[_CASSETTE] = session
    passed = False
    try:
        tap = Tap(session.service_url, process=pool.process).start()
        try:
            yield tap
        finally:
            tap.close()
        passed = request.node.stash.get(_PASSED, False)
    finally:
        session.finish(save=passed)
    if passed and session.unmatched and session.plan == "replay":  # (extend forwards and records them)
        pytest.fail(f"{session.unmatched} request(s) were not in cassette {cassette.path} (record mode "
                    f"{cassette.mode}): re-record it with --pulsar-record-mode=all", pytrace=False)


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _cassette_path(request: pytest.FixtureRequest, marker: pytest.Mark) -> Path:
    name = marker.kwargs.get("name", marker.args[0] if marker.args else None)
    test_file = Path(str(request.node.path))
    if name is None:
        parts = [test_file.stem, request.node.name]
    else:
        parts = [part for part in str(name).split("/") if part not in ("", ".", "..")]
        if not parts:
            raise pytest.UsageError(f"{request.node.nodeid}: pulsar_cassette name {name!r} names no file")
    return test_file.parent.joinpath("cassettes", *(_UNSAFE.sub("_", part) for part in parts))

"""The pytest plugin as users meet it: inner pytest runs (pytester) of small suites written like theirs.

- a test failing inside ``inject`` (with, decorator, Trio, asyncio) leaves no rule on the proxy;
- cassettes follow VCR.py's record modes: recorded once against a broker, then replayed with none
  (the upstream is an address where nothing listens), extended by ``new_episodes``, refused by
  ``none`` when missing, never written by a failing run, and a replay the cassette could not answer
  fails with that count;
- the shipped example cassette runs with no broker;
- loading the plugin imports nothing of the package and starts nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.broker.embedded import ThreadedCluster
from proxy.testing import Tap

NOWHERE = "pulsar://127.0.0.1:1"
REPO = Path(__file__).resolve().parents[2]

FAILING_INSIDE_INJECT = '''
import asyncio, os
import pytest, trio
from proxy.testing import AdminClient, drop, error

admin = AdminClient(os.environ["TAP_ADMIN"])

def test_with_block_fails():
    with admin.inject(error("ServiceNotReady").on("PRODUCER")):
        assert admin.rules(), "the rule is in force inside the block"
        assert False, "the test fails inside the block"

@admin.inject(drop().on("SEND"))
def test_decorated_fails():
    raise RuntimeError("the decorated test fails")

@pytest.mark.trio
async def test_trio_fails():
    async with admin.inject(drop().on("FLOW")):
        await trio.sleep(0)
        raise ValueError("the Trio test fails")

def test_asyncio_fails():
    async def main():
        async with admin.inject(drop().on("ACK")):
            raise LookupError("the asyncio test fails")
    asyncio.run(main())
'''

CASSETTE_SUITE = '''
import os
import pulsar
import pytest

TOPIC = os.environ.get("CASSETTE_TOPIC", "cassette-orders")

def _produce(url, topic, count=3):
    client = pulsar.Client(url, operation_timeout_seconds=int(os.environ.get("OPERATION_TIMEOUT", "10")))
    try:
        producer = client.create_producer(topic, batching_enabled=False)
        for i in range(count):
            producer.send(f"order-{i}".encode())
    finally:
        client.close()

@pytest.mark.pulsar_cassette("orders")
def test_orders(pulsar_tap, pulsar_cassette):
    _produce(pulsar_tap.service_url, TOPIC)
    print("PLAN", pulsar_cassette.plan)

@pytest.mark.pulsar_cassette("orders")
def test_swallows_an_unrecorded_request(pulsar_tap):
    try:
        _produce(pulsar_tap.service_url, "never-recorded", 1)
    except Exception:
        pass

@pytest.mark.pulsar_cassette("fresh")
def test_fails_while_recording(pulsar_tap):
    _produce(pulsar_tap.service_url, "fresh-topic", 1)
    assert False, "this run must not leave a cassette"
'''


FIXTURE_SUITE = '''
import pytest
from proxy.testing import drop

TAPS = []

def test_rules_added_here(pulsar_tap, pulsar_cluster):
    TAPS.append(pulsar_tap)
    pulsar_tap.admin.add_rule(drop().on("ACK").named("left-over"))
    assert len(pulsar_cluster.addresses) == 3  # --pulsar-brokers 3
    assert pulsar_tap.upstream_url == pulsar_cluster.service_url

def test_are_gone_in_the_next_test(pulsar_tap):
    assert pulsar_tap is TAPS[0]  # one tap for the session
    assert pulsar_tap.rules() == []
    pulsar_tap.close()  # a test may even close it

def test_a_closed_shared_tap_is_replaced(pulsar_tap):
    assert pulsar_tap.running and pulsar_tap is not TAPS[0]

@pytest.mark.pulsar_cluster(brokers=2, partitions=4)
def test_a_marker_asks_for_another_cluster(pulsar_tap, pulsar_cluster):
    assert len(pulsar_cluster.addresses) == 2
    assert pulsar_tap is not TAPS[0] and pulsar_tap.upstream_url == pulsar_cluster.service_url
'''


def test_fixtures_share_a_tap_per_cluster_and_clear_its_rules(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fixtures=FIXTURE_SUITE)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pulsar-brokers", "3")
    result.assert_outcomes(passed=4)


@pytest.fixture
def outer_tap() -> Iterator[Tap]:
    with Tap(NOWHERE) as tap:
        yield tap


def test_a_test_failing_inside_inject_leaves_no_rule_behind(pytester: pytest.Pytester, outer_tap: Tap,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAP_ADMIN", outer_tap.admin_url)
    pytester.makepyfile(test_inner=FAILING_INSIDE_INJECT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*the test fails inside the block*", "*the decorated test fails*",
                                 "*the Trio test fails*", "*the asyncio test fails*"])
    assert outer_tap.rules() == []


def _run(pytester: pytest.Pytester, *args: str, **env: str) -> pytest.RunResult:
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-s", *args)


def test_cassettes_follow_the_vcr_record_modes(pytester: pytest.Pytester, broker: ThreadedCluster) -> None:
    pytester.makepyfile(test_shop=CASSETTE_SUITE)
    cassette = pytester.path / "cassettes" / "orders"

    first = _run(pytester, "-k", "test_orders", "--pulsar-url", broker.service_url)  # once, missing: record
    first.assert_outcomes(passed=1)
    first.stdout.fnmatch_lines(["*PLAN record*"])
    assert len([p for p in cassette.iterdir() if p.is_dir()]) == 1

    replayed = _run(pytester, "-k", "test_orders", "--pulsar-url", NOWHERE)  # once, present: replay, no broker
    replayed.assert_outcomes(passed=1)
    replayed.stdout.fnmatch_lines(["*PLAN replay*"])

    other = {"CASSETTE_TOPIC": "cassette-returns"}
    missing = _run(pytester, "-k", "test_orders", "--pulsar-url", NOWHERE, OPERATION_TIMEOUT="2",
                   **other)  # not in the cassette: the client is refused
    missing.assert_outcomes(failed=1)

    extended = _run(pytester, "-k", "test_orders", "--pulsar-url", broker.service_url,
                    "--pulsar-record-mode", "new_episodes", **other)
    extended.assert_outcomes(passed=1)
    extended.stdout.fnmatch_lines(["*PLAN extend*"])
    assert len([p for p in cassette.iterdir() if p.is_dir()]) == 2
    for topic in ("cassette-orders", "cassette-returns"):
        again = _run(pytester, "-k", "test_orders", "--pulsar-url", NOWHERE, "--pulsar-record-mode", "none",
                     CASSETTE_TOPIC=topic)
        again.assert_outcomes(passed=1)

    unanswered = _run(pytester, "-k", "swallows", "--pulsar-url", NOWHERE, OPERATION_TIMEOUT="2")
    unanswered.assert_outcomes(passed=1, errors=1)
    unanswered.stdout.fnmatch_lines(["*request(s) were not in cassette*orders (record mode once)*"])

    failing = _run(pytester, "-k", "fails_while_recording", "--pulsar-url", broker.service_url)
    failing.assert_outcomes(failed=1)
    assert not (pytester.path / "cassettes" / "fresh").exists()
    refused = _run(pytester, "-k", "fails_while_recording", "--pulsar-url", broker.service_url,
                   "--pulsar-record-mode", "none")
    refused.assert_outcomes(errors=1)
    refused.stdout.fnmatch_lines(["*cassettes/fresh does not exist and the record mode is none*"])


def test_the_shipped_example_cassette_runs_with_no_broker() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/examples/test_cassette.py",
         "--pulsar-url", NOWHERE, "--pulsar-record-mode", "none"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout


def test_loading_the_plugin_imports_nothing_of_the_package() -> None:
    code = ("import sys, proxy.pytest_plugin; "
            "print(sorted(m for m in sys.modules if m.startswith(('proxy', 'trio', 'pulsar'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert out.strip() == "['proxy', 'proxy.pytest_plugin']"


def test_a_suite_that_uses_no_fixture_starts_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    before = {t.name for t in threading.enumerate()}
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    started = {t.name for t in threading.enumerate()} - before
    assert not [name for name in started if name.startswith("pulsar-tap")]
    helped = pytester.runpytest_inprocess("--help")
    helped.stdout.fnmatch_lines(["*pulsar-tap fixtures*", "*--pulsar-url=URL*", "*--pulsar-record-mode*"])


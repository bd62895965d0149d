"""Shipped rule files (``rules/*.yaml``, loaded unchanged) with the Java and Go clients against the real broker.

tests/rules/test_rule_files.py keeps every file's promise with the official Python client
on the embedded broker; here are the promises that differ by client, on the real
Apache Pulsar standalone, with the client programs of tests/peers/:

- ``flaky-producer-creation.yaml`` and ``broken-lookups.yaml``: the Java client retries a
  refused creation or lookup by itself; the Go client (pulsar-client-go) returns the
  refusal from ``CreateProducer`` / ``Subscribe`` and leaves the retry to the application.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from peers_rig import TENANT_NS, Upstream, proxy_running, run_with_watcher, service_url
from real_pulsar import run_client, start_client

from proxy.server.stack import ProxyStack

RULES = Path(__file__).parents[2] / "rules"


def _topic(label: str) -> str:
    return f"persistent://{TENANT_NS}/rule-files-{label}-{uuid.uuid4().hex[:8]}"


def _hits(proxy: ProxyStack) -> dict[str, int]:
    engine = proxy.engine
    assert engine is not None
    return dict(engine.hits())


@pytest.mark.parametrize(("rule_file", "codes"), [
    ("flaky-producer-creation.yaml", ("ServiceNotReady",)),
    ("broken-lookups.yaml", ("ServiceNotReady", "MetadataError")),
])
def test_a_refused_creation_is_retried_by_the_java_client_and_returned_by_the_go_client(
        rule_file: str, codes: tuple[str, ...], real_upstream: Upstream) -> None:
    upstream = real_upstream
    with proxy_running(upstream.service_url, lookup="rewrite", rules=str(RULES / rule_file)) as proxy:
        # the Go client first: it meets the file's first refusal
        go = run_client("go", service_url(proxy), _topic("go"), messages=50, batching=False, timeout=60)
        refused = str(go.report.get("error"))
        assert any(code in refused for code in codes), go.report
        assert not go.acked, "the Go client's creation failed: nothing was sent"
        java, dials = run_with_watcher(upstream, lambda: start_client(
            "java", service_url(proxy), _topic("java"), messages=200, batching=False, timeout=120))
        hits = _hits(proxy)
    assert java.report.get("error") is None and java.report["send_errors"] == 0, java.report
    assert len(java.acked_indices()) == 200 and sorted(set(java.received_indices())) == list(range(200))
    assert "client" not in dials.broker_peers
    if rule_file == "flaky-producer-creation.yaml":
        assert hits["not-ready-twice"] == 2  # the second refusal went to the Java client, which retried
    else:
        assert hits["lookup-metadata-error"] == 3 and hits["slow-lookups"] >= 1


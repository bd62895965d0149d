"""Pulsar transactions through pulsar-tap, against the real broker with its transaction coordinator enabled.

The Java client (tests/peers/java-client, ``--mode txn``) sends its messages in transactions
of ``--txn-size`` messages, one after the other, every second one aborted, then receives what
was committed and acknowledges it in one transaction it commits: TC_CLIENT_CONNECT_REQUEST,
NEW_TXN, ADD_PARTITION_TO_TXN, SEND with a txnid, END_TXN, ADD_SUBSCRIPTION_TO_TXN and ACK with
a txnid all cross the proxy.

- through ``pulsar-tap run`` in both lookup modes: every committed message is delivered once,
  no aborted one is, the recording decodes the transaction commands with their latencies, and
  the client never dials the broker (the coordinator's connection goes through the proxy too);
- ``pulsar-tap replay REC`` of such a session into the same broker: the coordinator gives the
  replayed transactions new ids, which the replay carries into the SENDs, ACKs and END_TXNs
  that name them (as it maps producer and consumer ids), so nothing differs; into the embedded
  broker, which has no coordinator, it differs exactly as into a real broker without one;
- rules on transaction commands: the client sees what the rule says and recovers as it does
  from the broker itself.

One standalone with ``transactionCoordinatorEnabled=true`` serves the module (module-scoped):
it starts in ~8.5 s where the shared one starts in ~8 s, but the shared one stays as it is
(its system topics and the coordinator's ledgers would change what other modules see).
The embedded broker runs as ``python -m proxy broker`` of the installed package (in a git
worktree, run with ``PYTHONPATH=$PWD`` to test the worktree's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from peers_rig import (
    Upstream,
    delivery_problems,
    embedded_running,
    leaked_addresses,
    proxy_running,
    run_with_watcher,
    service_url,
    show_json,
    upstream_of,
    wait_for,
)
from real_pulsar import ClientRun, Standalone, spawn, start_client, start_standalone, stop_process

TREE = Path(__file__).resolve().parents[2]
MESSAGES = 40
TXN_SIZE = 10
#: transactions 0 and 2 commit, 1 and 3 abort (--abort-every 2)
COMMITTED = [i for j in (0, 2) for i in range(j * TXN_SIZE, (j + 1) * TXN_SIZE)]
TXN_COMMANDS = ("TC_CLIENT_CONNECT_REQUEST", "NEW_TXN", "ADD_PARTITION_TO_TXN", "ADD_SUBSCRIPTION_TO_TXN", "END_TXN")


@pytest.fixture(scope="module")
def txn_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    broker = start_standalone(tmp_path_factory.mktemp("pulsar-txn"), extra={"transactionCoordinatorEnabled": "true"})
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def txn_upstream(txn_broker: Standalone) -> Upstream:
    return upstream_of(txn_broker)


def txn_client(url: str, topic: str, *, messages: int = MESSAGES, txn_timeout: float = 60,
               operation_timeout: float = 30, **options: Any) -> Any:
    return start_client("java", url, topic, messages=messages, mode="txn", idle=2, timeout=90,
                        extra_args=["--txn-size", str(TXN_SIZE), "--txn-timeout", str(txn_timeout),
                                    "--operation-timeout", str(operation_timeout)], **options)


def fresh_topic(prefix: str) -> str:
    return f"persistent://public/default/{prefix}-{uuid.uuid4().hex[:8]}"


def txn_problems(run: ClientRun) -> list[str]:
    """What is wrong with a report of ``--mode txn`` where every transaction should have ended as asked."""
    report = run.report
    problems = [f"{key}: {report.get(key)}" for key in ("error", "txn_errors") if report.get(key)]
    if (report.get("committed"), report.get("aborted")) != ([0, 2], [1, 3]):
        problems.append(f"committed {report.get('committed')}, aborted {report.get('aborted')}")
    if report.get("ack_txn") != "committed":
        problems.append(f"the acknowledging transaction: {report.get('ack_txn')}")
    if sorted(run.received_indices()) != COMMITTED:
        problems.append(f"received {run.received_indices()}, expected the committed {COMMITTED}")
    return problems


def only_recording(record_dir: Path) -> Path:
    recordings = [path for path in record_dir.iterdir() if path.is_dir()]
    assert len(recordings) == 1, recordings
    return recordings[0]


@pytest.mark.parametrize("lookup", ["rewrite", "proxy-through"])
def test_transactions_through_the_proxy_commit_and_abort_as_against_the_broker(
        lookup: str, txn_upstream: Upstream, tmp_path: Path) -> None:
    topic = fresh_topic(f"txn-{lookup}")
    with proxy_running(txn_upstream.service_url, lookup=lookup, record_dir=tmp_path) as proxy:
        run, dials = run_with_watcher(txn_upstream, lambda: txn_client(service_url(proxy), topic))
    assert txn_problems(run) == []
    # the coordinator's connection too: the client dialled only the proxy, only the proxy dialled the broker
    assert dials.client_remote_ports == {int(service_url(proxy).rsplit(":", 1)[1])} or \
        not dials.client_remote_ports & txn_upstream.broker_ports, dials
    assert dials.broker_peers <= {"proxy", "broker", "foreign"}, dials.others
    frames = show_json(only_recording(tmp_path))
    assert leaked_addresses(frames, txn_upstream.addresses) == []
    seen = {frame["command"] for frame in frames}
    assert set(TXN_COMMANDS) | {f"{c}_RESPONSE" for c in TXN_COMMANDS[1:]} <= seen, sorted(seen)
    ends = [f for f in frames if f["command"] == "END_TXN_RESPONSE" and f["origin"] == "broker"]
    assert len(ends) == 5 and all(f.get("request") == "END_TXN" and f["latency_us"] > 0 for f in ends), ends
    actions = [f["fields"]["txn_action"] for f in frames if f["command"] == "END_TXN"]
    assert actions == ["COMMIT", "ABORT", "COMMIT", "ABORT", "COMMIT"]
    sends = [f for f in frames if f["command"] == "SEND"]
    assert sends and all(f["fields"].get("txnid_least_bits") is not None for f in sends), sends[:2]


def replay(recording: Path, upstream_url: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", "replay", str(recording), "--upstream", upstream_url,
                           "--speed", "0", "--timeout", str(timeout), "--log-level", "error"],
                          capture_output=True, text=True, timeout=120, check=False, cwd=TREE)


def test_a_transactional_session_replays_with_the_coordinators_new_txnids(
        txn_upstream: Upstream, tmp_path: Path) -> None:
    """The live coordinator numbers the replayed transactions anew (it has issued ids since the recording):
    the SENDs, ACKs, ADD_*_TO_TXN and END_TXNs that named a recorded transaction name its replayed one.
    Replayed again through a proxy that holds every SEND 300 ms: each END_TXN still comes after the SENDs
    of its transaction are answered, as the recorded client sent it (the replay's coordinator connection
    is not its producer's).  Replayed into the embedded broker: refused as without a coordinator."""
    topic = fresh_topic("txn-replay")
    with proxy_running(txn_upstream.service_url, lookup="rewrite", record_dir=tmp_path / "rec") as proxy:
        recorded = txn_client(service_url(proxy), topic).result()
    assert txn_problems(recorded) == []
    recording = only_recording(tmp_path / "rec")
    # another client's transactions in between: the live ids cannot be the recorded ones by chance; and the
    # topic anew, where no recorded transaction ended (its consumers filter aborted messages by the txnid
    # in their metadata)
    assert txn_problems(txn_client(txn_upstream.service_url, fresh_topic("txn-between")).result()) == []
    txn_upstream.admin("DELETE", f"/admin/v2/persistent/{topic.removeprefix('persistent://')}?force=true")
    done = replay(recording, txn_upstream.service_url)
    assert done.returncode == 0, done.stderr[-3000:]
    assert " 0 differ" in done.stderr, done.stdout[-3000:] + done.stderr[-1500:]
    slow_sends = [{"name": "slow-sends", "match": {"command": ["SEND"]}, "action": {"delay": {"ms": 300}}}]
    with proxy_running(txn_upstream.service_url, lookup="rewrite", rules=slow_sends) as proxy:
        done = replay(recording, service_url(proxy))
    assert done.returncode == 0, done.stderr[-3000:]
    assert " 0 differ" in done.stderr, done.stdout[-3000:] + done.stderr[-1500:]
    # what the two replays committed is on the topic; what they aborted is not
    check = start_client("java", txn_upstream.service_url, topic, messages=len(COMMITTED) * 2, mode="consume",
                         subscription="after-replay", idle=3, timeout=60).result()
    assert sorted(check.received_indices()) == sorted(COMMITTED * 2), json.dumps(check.report)[:1500]

    # the embedded broker has no transaction coordinator: every transaction request, every SEND and ACK in a
    # transaction differs as error:NotAllowedError, the answers of a real broker with
    # transactionCoordinatorEnabled=false (measured: the same 41 DIFF lines for a session of 51 requests)
    sends = sum(1 for frame in show_json(recording) if frame["command"] == "SEND")
    with embedded_running(brokers=1) as embedded:
        done = replay(recording, embedded.service_url, timeout=2)
    assert done.returncode == 1, done.stderr[-3000:]  # 1: differences
    diffs = [line.split() for line in done.stdout.splitlines() if line.startswith("DIFF")]
    assert {(d[2], d[4], d[5]) for d in diffs} == {(command, "recorded=ok", "replayed=error:NotAllowedError") for
                                                   command in (*TXN_COMMANDS, "SEND", "ACK")}, done.stdout[-3000:]
    assert sum(1 for d in diffs if d[2] == "SEND") == sends, done.stdout[-3000:]  # a batch's refusal too


def test_replay_serve_answers_a_transactional_client_from_the_recording(txn_upstream: Upstream, tmp_path: Path) -> None:
    """``replay --serve``: the Java client opens, commits and aborts its transactions against the recording
    (the coordinator's answers as recorded) and receives what was committed."""
    topic = fresh_topic("txn-serve")
    with proxy_running(txn_upstream.service_url, lookup="rewrite", record_dir=tmp_path / "rec") as proxy:
        assert txn_problems(txn_client(service_url(proxy), topic).result()) == []
    ready = tmp_path / "ready.json"
    server = spawn([sys.executable, "-m", "proxy", "replay", str(only_recording(tmp_path / "rec")), "--serve",
                    "--listen", "127.0.0.1:0", "--ready-file", str(ready), "--log-level", "warning"],
                   tmp_path / "serve.log", TREE)
    try:
        wait_for(lambda: ready.exists() and ready.stat().st_size and server.poll() is None, 30, "replay --serve")
        served = f"pulsar://{json.loads(ready.read_text())['listen'][0]}"
        assert txn_problems(txn_client(served, topic, operation_timeout=5).result()) == []
    finally:
        stop_process(server, 5)
    assert "0 not in it" in (tmp_path / "serve.log").read_text(), (tmp_path / "serve.log").read_text()[-2000:]



def chaos_run(upstream: Upstream, rules: list[dict[str, Any]], record_dir: Path, *, operation_timeout: float = 30,
              txn_timeout: float = 60, beside: bool = False,
              ) -> tuple[ClientRun, ClientRun | None, list[dict[str, Any]]]:
    """The transactional client through a proxy with ``rules`` (and a plain roundtrip client on another topic
    beside it when ``beside``): its report, the other's, and the recording as ``show --json`` lines."""
    with proxy_running(upstream.service_url, lookup="rewrite", record_dir=record_dir,
                       rules={"seed": 1, "rules": rules}) as proxy:
        url = service_url(proxy)
        other = start_client("java", url, fresh_topic("txn-beside"), messages=200, idle=2, timeout=60) \
            if beside else None
        run = start_client("java", url, fresh_topic("txn-chaos"), messages=MESSAGES, mode="txn", idle=2, timeout=90,
                           extra_args=["--txn-size", str(TXN_SIZE), "--txn-timeout", str(txn_timeout),
                                       "--operation-timeout", str(operation_timeout)]).result()
        other_run = other.result() if other is not None else None
    return run, other_run, show_json(only_recording(record_dir))


def test_an_injected_txn_error_is_the_brokers_own_refusal_and_fails_only_that_transaction(
        txn_upstream: Upstream, tmp_path: Path) -> None:
    """``error`` on NEW_TXN and END_TXN answers with NEW_TXN_RESPONSE / END_TXN_RESPONSE carrying the error, as
    ServerCnx refuses them: the Java client fails that call at once.  (An ERROR frame there is one it does
    not route to its transaction coordinator handler: it waited out its operation timeout, then said Timeout.)"""
    rules = [{"name": "no-new-txn", "match": {"command": ["NEW_TXN"], "times": 1},
              "action": {"error": {"code": "ServiceNotReady"}}},
             # END_TXNs: transaction 1's abort, then transaction 2's commit, refused
             {"name": "no-commit", "match": {"command": ["END_TXN"], "after": 1, "times": 1},
              "action": {"error": {"code": "TransactionNotFound"}}}]
    run, _, frames = chaos_run(txn_upstream, rules, tmp_path, operation_timeout=5, txn_timeout=10)
    report = run.report
    errors = report["txn_errors"]
    assert sorted(errors) == ["0", "2"], report
    assert "TransactionCoordinatorClientException: injected by pulsar-tap" in errors["0"], errors
    assert "TransactionNotFoundException: injected by pulsar-tap" in errors["2"], errors
    assert (report["committed"], report["aborted"], report["error"]) == ([], [1, 3], None), report
    # transaction 2 stays open on the broker (its commit never reached it) until the coordinator times it out:
    # nothing of it, nor of the aborted ones, is delivered
    assert run.received_indices() == [], run.report
    injected = [f["command"] for f in frames if f["origin"] == "proxy" and f["direction"] == "to_client"
                and f["command"] != "LOOKUP_RESPONSE"]
    assert injected == ["NEW_TXN_RESPONSE", "END_TXN_RESPONSE"], injected


def test_a_lost_commit_answer_times_the_client_out_though_the_broker_committed(
        txn_upstream: Upstream, tmp_path: Path) -> None:
    """``drop`` of an END_TXN_RESPONSE: the client's commit times out (its operation timeout) while the broker
    did commit, so the messages are delivered — what a lost answer does against the broker alone."""
    rules = [{"name": "lost-commit", "match": {"command": ["END_TXN_RESPONSE"], "times": 1}, "action": "drop"}]
    run, _, _ = chaos_run(txn_upstream, rules, tmp_path, operation_timeout=3)
    report = run.report
    assert list(report["txn_errors"]) == ["0"] and "TimeoutException" in report["txn_errors"]["0"], report
    assert (report["committed"], report["aborted"], report["ack_txn"]) == ([2], [1, 3], "committed"), report
    assert sorted(run.received_indices()) == COMMITTED, report


def test_a_cut_connection_a_closed_producer_and_slow_coordinator_answers_end_every_transaction_as_asked(
        txn_upstream: Upstream, tmp_path: Path) -> None:
    """``disconnect`` on the first commit (the client reconnects and sends END_TXN again), ``close`` of the
    producer between a transaction's sends and its commit (it is re-created and resends them in the
    transaction), 200 ms on every coordinator answer: every transaction ends as asked, and a plain client on
    the same proxy is not disturbed."""
    rules = [{"name": "cut-commit", "match": {"command": ["END_TXN"], "times": 1}, "action": {"disconnect": {}}},
             {"name": "unload", "match": {"command": ["SEND"], "after": 2, "times": 1}, "action": {"close": {}}},
             {"name": "slow-tc", "match": {"command": ["NEW_TXN_RESPONSE", "END_TXN_RESPONSE"]},
              "action": {"delay": {"ms": 200}}}]
    run, other, frames = chaos_run(txn_upstream, rules, tmp_path, beside=True)
    assert txn_problems(run) == []
    assert other is not None and delivery_problems(other, 200) == []
    fired = {rule for frame in frames for rule in frame.get("rules") or ()}
    assert fired == {"cut-commit", "unload", "slow-tc"}, fired
    commits = [f["conn"] for f in frames if f["command"] == "END_TXN" and f["fields"]["txn_action"] == "COMMIT"]
    assert len(commits) == 4 and commits[0] != commits[1], commits  # the first one again, on a new connection
    assert run.report["elapsed_seconds"] >= 11 * 0.2, run.report


def test_analyze_pairs_every_transaction_command_of_a_recorded_session(txn_upstream: Upstream,
                                                                       tmp_path: Path) -> None:
    """``analyze``'s tables of a transactional session: every transaction request paired with its own response
    (an error inside one would count as an error), as ``show`` pairs them, and the scaled steps give the
    sequential reference's rows, split into small pieces."""
    import pyarrow.parquet as pq

    from proxy.analytics.reference import reference_tables
    from proxy.analytics.steps import analyze_in_process

    with proxy_running(txn_upstream.service_url, lookup="rewrite", record_dir=tmp_path / "rec") as proxy:
        assert txn_problems(txn_client(service_url(proxy), fresh_topic("txn-analyze")).result()) == []
    recording = only_recording(tmp_path / "rec")
    analyze_in_process([str(recording)], str(tmp_path / "out"), split_bytes=4096)
    requests = pq.read_table(tmp_path / "out" / "requests").to_pylist()
    txn = [r for r in requests if r["request_command"] in TXN_COMMANDS]
    counts = {command: sum(1 for r in txn if r["request_command"] == command) for command in TXN_COMMANDS}
    # one coordinator connection; 5 transactions (4 of messages, 1 of acknowledgements), each ended
    assert counts["NEW_TXN"] == 5 and counts["END_TXN"] == 5 and counts["ADD_PARTITION_TO_TXN"] >= 4, counts
    assert counts["ADD_SUBSCRIPTION_TO_TXN"] >= 1 and counts["TC_CLIENT_CONNECT_REQUEST"] >= 1, counts
    assert all(r["outcome"] == "ok" and r["response_command"] == r["request_command"].removesuffix("_REQUEST")
               + "_RESPONSE" and r["latency_us"] > 0 for r in txn), [r for r in txn if r["outcome"] != "ok"][:2]
    sends = [r for r in requests if r["request_command"] == "SEND"]
    assert sends and all(r["outcome"] == "ok" for r in sends), [r for r in sends if r["outcome"] != "ok"][:2]
    shown = {(f["command"], f.get("latency_us")) for f in show_json(recording)
             if f.get("request") in TXN_COMMANDS and f["origin"] == "broker"}
    assert len(shown) == len(txn)
    reference = reference_tables([recording])
    want = sorted((r["request_command"], r["start_ns"], r["end_ns"], r["outcome"]) for r in reference["requests"])
    assert sorted((r["request_command"], r["start_ns"], r["end_ns"], r["outcome"]) for r in requests) == want

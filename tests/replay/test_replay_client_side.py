"""Client-side replay's account and diff, with no broker: outcomes in, DIFF lines out."""

from __future__ import annotations

from pathlib import Path

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, frame_from_bytes
from proxy.replay.client_side import ReplayScore, TxnIds, load_conversations, steps_in_order
from proxy.replay.conversation import OK, UNANSWERED

SAMPLE = Path(__file__).resolve().parents[2] / "recordings" / "sample"


def test_steps_come_in_capture_order_across_connections() -> None:
    conversations, _ = load_conversations(str(SAMPLE))
    steps = list(steps_in_order(conversations))
    assert len(steps) == sum(len(conv.steps) for conv in conversations.values())
    times = [step.ts_ns for _, step in steps]
    assert times == sorted(times)


def test_only_a_different_outcome_is_a_diff_and_a_stopped_replay_compares_only_what_it_issued() -> None:
    conversations, _ = load_conversations(str(SAMPLE))
    exchanges = [e for conv in sorted(conversations.values(), key=lambda c: c.conn) for e in conv.exchanges
                 if not e.proxy_handled and e.outcome == OK]
    assert len(exchanges) > 2
    score = ReplayScore(conversations)
    for conv in conversations.values():
        for exchange in conv.exchanges:
            score.issued(exchange)
            score.answered(exchange, exchange.outcome)
    assert score.diffs() == []
    changed = exchanges[1]
    score.answered(changed, "error:ServiceNotReady")
    [diff] = score.diffs()
    assert (diff.command, diff.recorded, diff.replayed) == (changed.command, OK, "error:ServiceNotReady")
    assert diff.format().startswith(f"DIFF conn={diff.conn} {changed.command} topic=")

    stopped = ReplayScore(conversations)
    stopped.result.stopped = True
    stopped.issued(exchanges[0])  # issued, never answered: unanswered
    assert [(d.recorded, d.replayed) for d in stopped.diffs()] == [(OK, UNANSWERED)]
    assert stopped.result.requests == 1


def test_txn_ids_carry_the_live_coordinators_id_into_every_frame_that_names_the_recorded_one() -> None:
    ids = TxnIds()
    recorded = frame_from_bytes(encode_command(api.CommandNewTxnResponse(request_id=1, txnid_most_bits=0,
                                                                         txnid_least_bits=5)))
    live = frame_from_bytes(encode_command(api.CommandNewTxnResponse(request_id=7, txnid_most_bits=0,
                                                                     txnid_least_bits=42)))
    ids.learn(recorded, live)
    send = api.CommandSend(producer_id=1, sequence_id=0, txnid_most_bits=0, txnid_least_bits=5)
    metadata = api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1, txnid_most_bits=0,
                                   txnid_least_bits=5)
    end = api.CommandEndTxn(request_id=2, txnid_most_bits=0, txnid_least_bits=5, txn_action=api.COMMIT)
    assert [ids.translate(m) for m in (send, metadata, end)] == [True, True, True]
    assert {(m.txnid_most_bits, m.txnid_least_bits) for m in (send, metadata, end)} == {(0, 42)}
    # a frame naming no transaction, or one no NEW_TXN of the recording answered, is left as it is
    plain = api.CommandSend(producer_id=1, sequence_id=1)
    unknown = api.CommandAck(consumer_id=1, ack_type=api.CommandAck.Individual, txnid_most_bits=0,
                             txnid_least_bits=6)
    assert (ids.translate(plain), ids.translate(unknown)) == (False, False)
    assert not plain.HasField("txnid_least_bits") and unknown.txnid_least_bits == 6
    # an error answer to NEW_TXN maps nothing
    refused = frame_from_bytes(encode_command(api.CommandEndTxnResponse(request_id=3, error=api.TransactionNotFound)))
    ids.learn(frame_from_bytes(encode_command(api.CommandNewTxnResponse(request_id=4, txnid_least_bits=6))), refused)
    assert not ids.translate(unknown)

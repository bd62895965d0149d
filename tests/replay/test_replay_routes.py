"""``--unmatched forward``'s routing table and failure answers, with no upstream."""

from __future__ import annotations

from typing import Any

from proxy.errors import BrokerError, ConnectionFailed
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, encode_command, encode_payload_command, frame_from_bytes
from proxy.replay.routes import ForwardRoutes, failure_answer, has_request_id


def frame(sub: Any, payload: bool = False) -> Frame:
    data = (encode_payload_command(sub, api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1), b"x")
            if payload else encode_command(sub))
    return frame_from_bytes(data)


def test_frames_follow_their_producer_or_consumer_to_the_connection_it_was_created_on() -> None:
    routes: ForwardRoutes[str] = ForwardRoutes()
    producer = frame(api.CommandProducer(topic="t", producer_id=1, request_id=1))
    subscribe = frame(api.CommandSubscribe(topic="t", subscription="s", consumer_id=2, request_id=2,
                                           subType=api.CommandSubscribe.Shared))
    send = frame(api.CommandSend(producer_id=1, sequence_id=0), payload=True)
    flow = frame(api.CommandFlow(consumer_id=2, messagePermits=10))
    assert routes.route(send) is None and routes.route(flow) is None  # nothing bound yet
    assert routes.bind(producer, "broker-a") == ("producer", 1)
    assert routes.bind(subscribe, "broker-b") == ("consumer", 2)
    assert routes.bind(send, "broker-c") is None
    assert (routes.route(send), routes.route(flow)) == ("broker-a", "broker-b")
    assert routes.route(subscribe) is None  # a SUBSCRIBE is routed by its topic, never by its id
    assert has_request_id(producer) and not has_request_id(send) and not has_request_id(flow)
    assert routes.forget(producer) == ("broker-a", "producer", 1)
    assert routes.route(send) is None and routes.forget(producer) is None


def test_a_refusal_keeps_the_brokers_code_and_an_unreachable_upstream_is_service_not_ready() -> None:
    refused = frame_from_bytes(failure_answer(7, BrokerError("ProducerBusy", "taken"))).command.error
    assert (refused.request_id, refused.error, refused.message) == (7, api.ServerError.ProducerBusy, "taken")
    unknown = frame_from_bytes(failure_answer(8, BrokerError("NoSuchCode", "?"))).command.error
    assert unknown.error == api.ServerError.UnknownError
    gone = frame_from_bytes(failure_answer(9, ConnectionFailed("refused"))).command.error
    assert (gone.error, gone.message) == (api.ServerError.ServiceNotReady, "upstream: refused")

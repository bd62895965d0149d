"""The frames the actions put on the wire, built with the protocol encoders.

- ``error``: the reply a broker gives when it refuses the request (Pulsar binary
  protocol, "Error handling"): SEND_ERROR for SEND, a LOOKUP_RESPONSE or
  PARTITIONED_METADATA_RESPONSE with ``response = Failed`` for lookups, ERROR with
  the ``request_id`` for every other request;
- ``close``: CLOSE_PRODUCER / CLOSE_CONSUMER as a broker sends on a topic unload
  (``request_id`` -1, as ServerCnx does), and the same close as a request to the
  broker so that the client's re-creation succeeds (what happens in between:
  :mod:`proxy.rules.unload`);
- ``corrupt``: a damaged checksum, payload or metadata (the latter two re-encoded
  with a fresh checksum, so only the content is wrong);
- ``rewrite``: fields of the sub-command set from a template;
- ``redirect``: a LOOKUP_RESPONSE of type Redirect to another broker.

Which command types each action can act on is fixed here too, so the loader can
refuse a rule that could never do what it says.
"""

from __future__ import annotations

import random
import struct
from typing import Any, Final

from google.protobuf import json_format
from google.protobuf.message import Message

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import SUB_FIELDS, sub_command
from proxy.protocol.frame import Frame, encode_command, encode_payload_command
from proxy.protocol.session import RESPONSES
from proxy.rules.unload import Kind

T = api.BaseCommand.Type

#: request_id a broker puts in the CLOSE_PRODUCER / CLOSE_CONSUMER it originates (-1 as uint64)
BROKER_INITIATED_REQUEST_ID: Final = (1 << 64) - 1

#: requests ``error`` can answer on the broker's behalf
ANSWERABLE: Final = frozenset(RESPONSES) | {T.SEND, T.CONNECT}
#: commands that name a producer (``close`` closes it)
PRODUCER_FRAMES: Final = frozenset({T.SEND, T.SEND_RECEIPT, T.SEND_ERROR})
#: commands that name a consumer (``close`` closes it)
CONSUMER_FRAMES: Final = frozenset({T.MESSAGE, T.FLOW, T.ACK, T.ACK_RESPONSE,
                                    T.REDELIVER_UNACKNOWLEDGED_MESSAGES})
CLOSABLE: Final = PRODUCER_FRAMES | CONSUMER_FRAMES
#: commands with a payload section (``corrupt``)
CORRUPTIBLE: Final = frozenset({T.SEND, T.MESSAGE})
#: what ``throttle`` paces: producers' SENDs and consumers' FLOW permits
THROTTLEABLE: Final = frozenset({T.SEND, T.FLOW})
#: what ``redirect`` answers
REDIRECTABLE: Final = frozenset({T.LOOKUP})

#: the commands an action applies to when the rule names none (None: any command)
#: the commands whose payload can be a replication marker (what ``match.marker`` looks at)
MARKER_CARRIERS: Final = frozenset({T.SEND, T.MESSAGE})

DEFAULT_COMMANDS: Final[dict[str, frozenset[int] | None]] = {
    "error": ANSWERABLE, "close": CLOSABLE, "corrupt": CORRUPTIBLE, "throttle": THROTTLEABLE,
    "redirect": REDIRECTABLE,
}

_U32 = struct.Struct(">I")


def error_reply(frame: Frame, code: str, message: str) -> bytes | None:
    """The refusal a broker would send for the request in ``frame``; None if it is no request."""
    error = api.ServerError.Value(code)
    sub: Any = frame.sub
    kind = frame.type
    if kind == T.SEND:
        return encode_command(api.CommandSendError(producer_id=sub.producer_id, sequence_id=sub.sequence_id,
                                                   error=error, message=message))
    if kind == T.LOOKUP:
        return encode_command(api.CommandLookupTopicResponse(
            request_id=sub.request_id, response=api.CommandLookupTopicResponse.Failed, error=error,
            message=message))
    if kind == T.PARTITIONED_METADATA:
        return encode_command(api.CommandPartitionedTopicMetadataResponse(
            request_id=sub.request_id, response=api.CommandPartitionedTopicMetadataResponse.Failed,
            error=error, message=message))
    if kind == T.CONNECT:
        # A refused CONNECT gets an ERROR that answers no request (request_id -1, as ServerCnx does).
        return encode_command(api.CommandError(request_id=BROKER_INITIATED_REQUEST_ID, error=error,
                                               message=message))
    if kind in ANSWERABLE and sub.HasField("request_id"):
        return encode_command(api.CommandError(request_id=sub.request_id, error=error, message=message))
    return None


def close_frames(frame: Frame, upstream_request_id: int) -> tuple[Kind, int, bytes, bytes] | None:
    """(kind, id, CLOSE to the client, CLOSE request to the broker) for the producer/consumer of ``frame``."""
    sub: Any = frame.sub
    if frame.type in PRODUCER_FRAMES:
        producer_id = sub.producer_id
        return (Kind.PRODUCER, producer_id,
                encode_command(api.CommandCloseProducer(producer_id=producer_id,
                                                        request_id=BROKER_INITIATED_REQUEST_ID)),
                encode_command(api.CommandCloseProducer(producer_id=producer_id, request_id=upstream_request_id)))
    if frame.type in CONSUMER_FRAMES:
        consumer_id = sub.consumer_id
        return (Kind.CONSUMER, consumer_id,
                encode_command(api.CommandCloseConsumer(consumer_id=consumer_id,
                                                        request_id=BROKER_INITIATED_REQUEST_ID)),
                encode_command(api.CommandCloseConsumer(consumer_id=consumer_id, request_id=upstream_request_id)))
    return None


def _flip(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return data
    index = rng.randrange(len(data))
    flipped = bytearray(data)
    flipped[index] ^= 1 << rng.randrange(8)
    return bytes(flipped)


def corrupt(frame: Frame, what: str, rng: random.Random) -> bytes | None:
    """``frame`` with its checksum, payload or metadata damaged; None for frames without a payload."""
    section = frame.payload
    if section is None:
        return None
    if what == "checksum":
        position = section.checksum_start - 4
        damaged = (section.checksum ^ (1 << rng.randrange(32))) & 0xFFFFFFFF
        return frame.raw[:position] + _U32.pack(damaged) + frame.raw[position + 4:]
    metadata, payload = section.metadata_raw, section.payload
    if what == "payload":
        payload = _flip(payload, rng)
    else:
        metadata = _flip(metadata, rng)
    return encode_payload_command(frame.command, metadata, payload,
                                  broker_entry_metadata=section.broker_entry_metadata_raw)


def rewrite_template(command: int, fields: dict[str, Any]) -> Message:
    """The sub-command of type ``command`` holding ``fields``; ValueError names a bad field."""
    cmd = api.BaseCommand(type=command)
    template = sub_command(cmd)
    try:
        json_format.ParseDict(fields, template)
    except json_format.ParseError as exc:
        raise ValueError(str(exc)) from None
    return template


def rewrite(frame: Frame, template: Message, field_names: tuple[str, ...]) -> bytes:
    """``frame`` with the fields named set as in ``template`` (others unchanged), re-encoded."""
    cmd = api.BaseCommand()
    cmd.CopyFrom(frame.command)
    sub = getattr(cmd, SUB_FIELDS[cmd.type])
    for name in field_names:
        sub.ClearField(name)
    sub.MergeFrom(template)
    section = frame.payload
    if section is None:
        return encode_command(cmd)
    return encode_payload_command(cmd, section.metadata_raw, section.payload,
                                  broker_entry_metadata=section.broker_entry_metadata_raw)


def redirect_reply(frame: Frame, url: str, url_tls: str | None, authoritative: bool) -> bytes | None:
    """A LOOKUP_RESPONSE sending the client to ``url``; None unless ``frame`` is a LOOKUP."""
    if frame.type != T.LOOKUP:
        return None
    sub: Any = frame.sub
    response = api.CommandLookupTopicResponse(
        request_id=sub.request_id, response=api.CommandLookupTopicResponse.Redirect,
        brokerServiceUrl=url, authoritative=authoritative)
    if url_tls is not None:
        response.brokerServiceUrlTls = url_tls
    return encode_command(response)


def flow_frame(consumer_id: int, permits: int) -> bytes:
    return encode_command(api.CommandFlow(consumer_id=consumer_id, messagePermits=permits))

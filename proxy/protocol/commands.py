"""BaseCommand types: names, the sub-command field of each, wrapping, and what each command is.

Pulsar's ``BaseCommand`` carries a ``type`` and exactly one optional sub-command
whose field number equals the type's value (PulsarApi.proto, ``message
BaseCommand``).  This module turns that rule into lookup tables so the rest of
the project can say ``wrap(CommandPing())`` or ``sub_command(cmd)`` without a
hand-written switch over eighty types.

It is also the one place that knows, per command, who sends it
(:data:`CLIENT_COMMANDS`, :data:`BROKER_COMMANDS`), which responses answer it
(:data:`RESPONSES`), whether it is on the data path, and what it names: a producer
(:data:`NAMES_PRODUCER`, read from the generated descriptors: the commands whose
sub-command has a ``producer_id``), a consumer (:data:`NAMES_CONSUMER`), a request
(:data:`NAMES_REQUEST`), and by which field a session attributes it
(:data:`ATTRIBUTION`).  The session machine, the rules, the replay server and the
client take their per-command sets from here (``tests/protocol/test_commands.py``
checks them against the upstream PulsarApi.proto).  :data:`T` is the command
types as plain ints, the one alias the project uses.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Final

from google.protobuf.message import Message

from proxy.errors import UnknownCommand
from proxy.pb import PulsarApi_pb2 as api

BaseCommand = api.BaseCommand
Type = api.BaseCommand.Type

#: type value -> name, e.g. 6 -> "SEND"
TYPE_NAMES: Final[dict[int, str]] = {
    v.number: v.name for v in api.BaseCommand.DESCRIPTOR.enum_types_by_name["Type"].values
}
#: name -> type value, e.g. "SEND" -> 6
TYPE_VALUES: Final[dict[str, int]] = {name: number for number, name in TYPE_NAMES.items()}

#: type value -> name of the BaseCommand field holding its sub-command
SUB_FIELDS: Final[dict[int, str]] = {
    f.number: f.name for f in api.BaseCommand.DESCRIPTOR.fields if f.number in TYPE_NAMES
}

#: sub-command message name -> type value, e.g. "CommandSend" -> 6
_TYPE_OF_MESSAGE: Final[dict[str, int]] = {
    f.message_type.name: f.number
    for f in api.BaseCommand.DESCRIPTOR.fields
    if f.number in TYPE_NAMES and f.message_type is not None
}

#: Command type values as plain ints (``T.SEND == 6``): attribute lookups on protobuf's enum
#: wrapper are slow, and frames' types are compared on every frame.
T: Final[Any] = SimpleNamespace(**TYPE_VALUES)

#: the commands that carry a message payload after the command
PAYLOAD_TYPES: Final[frozenset[int]] = frozenset({T.SEND, T.MESSAGE})


def _carrying(field_name: str) -> frozenset[int]:
    """The command types whose sub-command has a singular field ``field_name``."""
    found = set()
    for number, field in SUB_FIELDS.items():
        message = api.BaseCommand.DESCRIPTOR.fields_by_name[field].message_type
        carried = message.fields_by_name.get(field_name) if message is not None else None
        if carried is not None and not carried.is_repeated:
            found.add(number)
    return frozenset(found)


#: commands naming a producer by ``producer_id``
NAMES_PRODUCER: Final = _carrying("producer_id")
#: commands naming a consumer by ``consumer_id``
NAMES_CONSUMER: Final = _carrying("consumer_id")
#: commands carrying a ``request_id``
NAMES_REQUEST: Final = _carrying("request_id")
#: commands that create the producer or consumer they name (the others act on an existing one)
CREATES_ID: Final = frozenset({T.PRODUCER, T.SUBSCRIBE, T.SCALABLE_TOPIC_SUBSCRIBE})
#: scalable topics' commands: in the definitions, in no Pulsar release; nothing here speaks them
SCALABLE_TOPIC_TYPES: Final = frozenset(v for name, v in TYPE_VALUES.items() if "SCALABLE_TOPIC" in name)

#: Commands a client (or a broker acting as a client of another broker) sends.
CLIENT_COMMANDS: Final = frozenset({
    T.CONNECT, T.SUBSCRIBE, T.PRODUCER, T.SEND, T.ACK, T.FLOW, T.UNSUBSCRIBE, T.CLOSE_PRODUCER,
    T.CLOSE_CONSUMER, T.PING, T.PONG, T.REDELIVER_UNACKNOWLEDGED_MESSAGES, T.PARTITIONED_METADATA,
    T.LOOKUP, T.CONSUMER_STATS, T.SEEK, T.GET_LAST_MESSAGE_ID, T.GET_TOPICS_OF_NAMESPACE, T.GET_SCHEMA,
    T.AUTH_RESPONSE, T.GET_OR_CREATE_SCHEMA, T.NEW_TXN, T.ADD_PARTITION_TO_TXN, T.ADD_SUBSCRIPTION_TO_TXN,
    T.END_TXN, T.END_TXN_ON_PARTITION, T.END_TXN_ON_SUBSCRIPTION, T.TC_CLIENT_CONNECT_REQUEST,
    T.WATCH_TOPIC_LIST, T.WATCH_TOPIC_LIST_CLOSE, T.SCALABLE_TOPIC_LOOKUP, T.SCALABLE_TOPIC_CLOSE,
    T.SCALABLE_TOPIC_SUBSCRIBE, T.WATCH_SCALABLE_TOPICS, T.WATCH_SCALABLE_TOPICS_CLOSE,
    T.WATCH_TC_ASSIGNMENTS, T.WATCH_TC_ASSIGNMENTS_CLOSE,
})
#: Commands a broker sends.
BROKER_COMMANDS: Final = frozenset({
    T.CONNECTED, T.SEND_RECEIPT, T.SEND_ERROR, T.MESSAGE, T.SUCCESS, T.ERROR, T.CLOSE_PRODUCER,
    T.CLOSE_CONSUMER, T.PRODUCER_SUCCESS, T.PING, T.PONG, T.PARTITIONED_METADATA_RESPONSE,
    T.LOOKUP_RESPONSE, T.CONSUMER_STATS_RESPONSE, T.REACHED_END_OF_TOPIC, T.GET_LAST_MESSAGE_ID_RESPONSE,
    T.ACTIVE_CONSUMER_CHANGE, T.GET_TOPICS_OF_NAMESPACE_RESPONSE, T.GET_SCHEMA_RESPONSE, T.AUTH_CHALLENGE,
    T.ACK_RESPONSE, T.GET_OR_CREATE_SCHEMA_RESPONSE, T.NEW_TXN_RESPONSE, T.ADD_PARTITION_TO_TXN_RESPONSE,
    T.ADD_SUBSCRIPTION_TO_TXN_RESPONSE, T.END_TXN_RESPONSE, T.END_TXN_ON_PARTITION_RESPONSE,
    T.END_TXN_ON_SUBSCRIPTION_RESPONSE, T.TC_CLIENT_CONNECT_RESPONSE, T.WATCH_TOPIC_LIST_SUCCESS,
    T.WATCH_TOPIC_UPDATE, T.TOPIC_MIGRATED, T.SCALABLE_TOPIC_UPDATE, T.SCALABLE_TOPIC_SUBSCRIBE_RESPONSE,
    T.SCALABLE_TOPIC_ASSIGNMENT_UPDATE, T.WATCH_SCALABLE_TOPICS_UPDATE, T.WATCH_TC_ASSIGNMENTS_UPDATE,
})

#: the client's frames acting on a producer / consumer it has (the server relays them by id)
PRODUCER_REQUESTS: Final = (NAMES_PRODUCER & CLIENT_COMMANDS) - CREATES_ID
CONSUMER_REQUESTS: Final = (NAMES_CONSUMER & CLIENT_COMMANDS) - CREATES_ID

#: request type -> the response types that answer it (matched by request_id)
RESPONSES: Final[dict[int, frozenset[int]]] = {
    T.PARTITIONED_METADATA: frozenset({T.PARTITIONED_METADATA_RESPONSE, T.ERROR}),
    T.LOOKUP: frozenset({T.LOOKUP_RESPONSE, T.ERROR}),
    T.PRODUCER: frozenset({T.PRODUCER_SUCCESS, T.ERROR}),
    T.SUBSCRIBE: frozenset({T.SUCCESS, T.ERROR}),
    T.UNSUBSCRIBE: frozenset({T.SUCCESS, T.ERROR}),
    T.CLOSE_PRODUCER: frozenset({T.SUCCESS, T.ERROR}),
    T.CLOSE_CONSUMER: frozenset({T.SUCCESS, T.ERROR}),
    T.SEEK: frozenset({T.SUCCESS, T.ERROR}),
    T.GET_LAST_MESSAGE_ID: frozenset({T.GET_LAST_MESSAGE_ID_RESPONSE, T.ERROR}),
    T.CONSUMER_STATS: frozenset({T.CONSUMER_STATS_RESPONSE, T.ERROR}),
    T.GET_TOPICS_OF_NAMESPACE: frozenset({T.GET_TOPICS_OF_NAMESPACE_RESPONSE, T.ERROR}),
    T.GET_SCHEMA: frozenset({T.GET_SCHEMA_RESPONSE, T.ERROR}),
    T.GET_OR_CREATE_SCHEMA: frozenset({T.GET_OR_CREATE_SCHEMA_RESPONSE, T.ERROR}),
    T.ACK: frozenset({T.ACK_RESPONSE, T.ERROR}),
    T.NEW_TXN: frozenset({T.NEW_TXN_RESPONSE, T.ERROR}),
    T.ADD_PARTITION_TO_TXN: frozenset({T.ADD_PARTITION_TO_TXN_RESPONSE, T.ERROR}),
    T.ADD_SUBSCRIPTION_TO_TXN: frozenset({T.ADD_SUBSCRIPTION_TO_TXN_RESPONSE, T.ERROR}),
    T.END_TXN: frozenset({T.END_TXN_RESPONSE, T.ERROR}),
    T.END_TXN_ON_PARTITION: frozenset({T.END_TXN_ON_PARTITION_RESPONSE, T.ERROR}),
    T.END_TXN_ON_SUBSCRIPTION: frozenset({T.END_TXN_ON_SUBSCRIPTION_RESPONSE, T.ERROR}),
    T.TC_CLIENT_CONNECT_REQUEST: frozenset({T.TC_CLIENT_CONNECT_RESPONSE, T.ERROR}),
    T.WATCH_TOPIC_LIST: frozenset({T.WATCH_TOPIC_LIST_SUCCESS, T.ERROR}),
    T.WATCH_TOPIC_LIST_CLOSE: frozenset({T.SUCCESS, T.ERROR}),
}
#: the types of every frame that answers a request_id
RESPONSE_TYPES: Final = frozenset().union(*RESPONSES.values())

#: the broker's frames about one producer / consumer that answer no request (routed by id)
PRODUCER_NOTICES: Final = (NAMES_PRODUCER & BROKER_COMMANDS) - RESPONSE_TYPES - SCALABLE_TOPIC_TYPES
CONSUMER_NOTICES: Final = (NAMES_CONSUMER & BROKER_COMMANDS) - RESPONSE_TYPES - SCALABLE_TOPIC_TYPES

#: The data path: frames sent per message or per batch.  A tracker user that needs only their
#: attribution (a rules hook) may skip accounting for them: :meth:`SessionTracker.attribute`
#: gives the same topic / producer / consumer without the pending SENDs and ACKs or the FLOW
#: permits, and :func:`accounted_types` says which of them must still be observed.
DATA_PATH_TYPES: Final = frozenset({T.SEND, T.SEND_RECEIPT, T.SEND_ERROR, T.MESSAGE, T.FLOW, T.ACK,
                                    T.ACK_RESPONSE})

#: Which field of a command's sub-command names what it is about (SessionTracker attributes by it).
ATTRIBUTION: Final[dict[int, str]] = {
    T.SEND: "producer_id", T.SEND_RECEIPT: "producer_id", T.SEND_ERROR: "producer_id",
    T.CLOSE_PRODUCER: "producer_id", T.PRODUCER_SUCCESS: "request_id",
    T.MESSAGE: "consumer_id", T.ACK: "consumer_id", T.FLOW: "consumer_id",
    T.UNSUBSCRIBE: "consumer_id", T.CLOSE_CONSUMER: "consumer_id",
    T.REDELIVER_UNACKNOWLEDGED_MESSAGES: "consumer_id", T.CONSUMER_STATS: "consumer_id",
    T.REACHED_END_OF_TOPIC: "consumer_id", T.SEEK: "consumer_id", T.GET_LAST_MESSAGE_ID: "consumer_id",
    T.ACTIVE_CONSUMER_CHANGE: "consumer_id", T.ACK_RESPONSE: "consumer_id",
    T.PRODUCER: "topic", T.SUBSCRIBE: "topic", T.LOOKUP: "topic", T.PARTITIONED_METADATA: "topic",
    T.GET_SCHEMA: "topic", T.GET_OR_CREATE_SCHEMA: "topic",
}


def type_name(type_value: int) -> str:
    """The BaseCommand type name for a value; ``UNKNOWN(n)`` for values no version defines."""
    return TYPE_NAMES.get(type_value, f"UNKNOWN({type_value})")


def type_value(name: str) -> int:
    """The BaseCommand type value for a name such as ``"SEND"``."""
    try:
        return TYPE_VALUES[name]
    except KeyError:
        raise ValueError(f"unknown command type name {name!r}") from None


def wrap(sub: Message) -> api.BaseCommand:
    """A BaseCommand holding ``sub`` with its type set from the sub-command's message type."""
    try:
        number = _TYPE_OF_MESSAGE[sub.DESCRIPTOR.name]
    except KeyError:
        raise TypeError(f"{sub.DESCRIPTOR.name} is not a BaseCommand sub-command") from None
    cmd = api.BaseCommand(type=number)
    getattr(cmd, SUB_FIELDS[number]).CopyFrom(sub)
    return cmd


def sub_command(cmd: api.BaseCommand) -> Message:
    """The sub-command a BaseCommand carries for its type (a default instance if unset)."""
    field = SUB_FIELDS.get(cmd.type)
    if field is None:
        raise UnknownCommand(cmd.type)
    sub: Message = getattr(cmd, field)
    return sub

"""BaseCommand types: names, the sub-command field of each, and wrapping.

Pulsar's ``BaseCommand`` carries a ``type`` and exactly one optional sub-command
whose field number equals the type's value (PulsarApi.proto, ``message
BaseCommand``).  This module turns that rule into lookup tables so the rest of
the project can say ``wrap(CommandPing())`` or ``sub_command(cmd)`` without a
hand-written switch over eighty types.
"""

from __future__ import annotations

from typing import Final

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

#: the commands that carry a message payload after the command
PAYLOAD_TYPES: Final[frozenset[int]] = frozenset({Type.SEND, Type.MESSAGE})


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

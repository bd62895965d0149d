"""Message ids and received messages as the built-in client hands them to users.

A :class:`MessageId` is Pulsar's ``MessageIdData``: ledger id, entry id, the
partition index (-1 for a topic that is not partitioned) and, for a message inside
a batch, its batch index and the batch size.  Ids order as the broker stores
messages: by ledger, then entry, then batch index.  ``serialize``/``deserialize``
give the protobuf bytes the official clients also use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from proxy.errors import MetadataDecodeError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import decode_message

_MAX_LONG: Final = (1 << 63) - 1
_U64: Final = (1 << 64) - 1


def _signed(value: int) -> int:
    """A uint64 wire value as the Java long it stands for (-1 is written as 2**64 - 1)."""
    return value - (1 << 64) if value > _MAX_LONG else value


@dataclass(frozen=True, slots=True, order=True)
class MessageId:
    """Where a message is stored."""

    ledger_id: int
    entry_id: int
    batch_index: int = -1
    partition: int = field(default=-1, compare=False)
    batch_size: int = field(default=0, compare=False)

    @classmethod
    def from_proto(cls, data: api.MessageIdData, partition: int | None = None) -> MessageId:
        return cls(
            ledger_id=_signed(data.ledgerId), entry_id=_signed(data.entryId),
            batch_index=data.batch_index if data.HasField("batch_index") else -1,
            partition=data.partition if partition is None else partition,
            batch_size=data.batch_size if data.HasField("batch_size") else 0,
        )

    def to_proto(self, *, with_batch: bool = True) -> api.MessageIdData:
        data = api.MessageIdData(ledgerId=self.ledger_id & _U64, entryId=self.entry_id & _U64)
        if self.partition >= 0:
            data.partition = self.partition
        if with_batch and self.batch_index >= 0:
            data.batch_index = self.batch_index
            if self.batch_size:
                data.batch_size = self.batch_size
        return data

    @property
    def entry(self) -> MessageId:
        """The id of the whole stored entry (a batch counts as one entry)."""
        return MessageId(self.ledger_id, self.entry_id, -1, self.partition)

    def serialize(self) -> bytes:
        return bytes(self.to_proto().SerializeToString())

    @classmethod
    def deserialize(cls, data: bytes) -> MessageId:
        try:
            return cls.from_proto(decode_message(api.MessageIdData, data, "MessageIdData"))
        except MetadataDecodeError as exc:
            raise ValueError(str(exc)) from None

    def __str__(self) -> str:
        return f"({self.ledger_id},{self.entry_id},{self.partition},{self.batch_index})"


#: The position before every message of a topic.
EARLIEST: Final = MessageId(-1, -1)
#: The position after the last message of a topic.
LATEST: Final = MessageId(_MAX_LONG, _MAX_LONG)


@dataclass(slots=True)
class Message:
    """A message as a consumer receives it (decompressed, split out of its batch)."""

    topic: str
    message_id: MessageId
    payload: bytes
    key: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    event_time: int = 0
    publish_time: int = 0
    sequence_id: int = -1
    producer_name: str = ""
    redelivery_count: int = 0
    ordering_key: bytes | None = None
    #: the consumer that received it (for acknowledgements); not part of the message
    consumer_id: int = field(default=-1, repr=False)

    def data(self) -> bytes:
        """The payload (the official client's name for it)."""
        return self.payload

    def partition_key(self) -> str | None:
        return self.key

"""The one error hierarchy of pulsar-tap.

Everything the project raises on purpose derives from :class:`PulsarTapError`.
Protocol errors carry the Pulsar ``ServerError`` name that a broker would answer
with, so a session can turn a local failure into the right wire reply; config
errors carry the file, line and dotted key that the user must fix.  Nothing from
``struct``, ``protobuf`` or the compression libraries escapes to a user: the
codec catches those at its edge and re-raises one of these.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


def find_error(exc: BaseException, kind: type[E]) -> E | None:
    """``exc`` if it is a ``kind``, else the first ``kind`` inside it (Trio wraps errors in nested groups)."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = find_error(inner, kind)
            if found is not None:
                return found
    return None


class PulsarTapError(Exception):
    """Base of every error pulsar-tap raises deliberately."""


class ProtocolError(PulsarTapError):
    """The bytes on the wire break the Pulsar binary protocol.

    ``server_error`` is the ServerError name a broker would reply with.
    """

    server_error: str = "UnknownError"


class FrameTooLarge(ProtocolError):
    """A frame is larger than the negotiated maximum."""

    server_error = "TooManyRequests"

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class MalformedFrame(ProtocolError):
    """Sizes inside a frame are inconsistent, or a section is truncated."""


class BadMagic(MalformedFrame):
    """A payload section does not start with a known magic number."""


class ChecksumMismatch(ProtocolError):
    """A payload's CRC32C does not match the checksum in its frame."""

    server_error = "ChecksumError"

    def __init__(self, expected: int, actual: int) -> None:
        super().__init__(f"checksum mismatch: frame says {expected:#010x}, payload has {actual:#010x}")
        self.expected = expected
        self.actual = actual


class UnknownCommand(ProtocolError):
    """The BaseCommand type is not one this protocol version defines."""

    def __init__(self, type_value: int) -> None:
        super().__init__(f"unknown command type {type_value}")
        self.type_value = type_value


class CommandDecodeError(ProtocolError):
    """A BaseCommand could not be decoded."""


class CommandEncodeError(ProtocolError):
    """A command could not be encoded (e.g. a rewrite left a required field unset)."""


class MetadataDecodeError(ProtocolError):
    """A MessageMetadata, SingleMessageMetadata or BrokerEntryMetadata could not be decoded."""


class CompressionError(ProtocolError):
    """A payload could not be compressed or decompressed as its metadata says."""


class BatchError(ProtocolError):
    """A batched payload does not hold the messages its metadata announces."""


class ChunkError(ProtocolError):
    """Chunks of a large message are missing, out of order or inconsistent."""


class MarkerError(ProtocolError):
    """A replication marker's payload could not be decoded."""


class RecordingError(PulsarTapError):
    """A recording directory or segment cannot be read or written (damaged, missing, not a recording)."""


class ConfigError(PulsarTapError):
    """A configuration or rule file is wrong; names the file, line and dotted key."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 key: str | None = None) -> None:
        self.message = message
        self.file = file
        self.line = line
        self.key = key
        super().__init__(self.format())

    def format(self) -> str:
        """Render as ``FILE:LINE: KEY: message`` (parts that are unknown are left out)."""
        parts: list[str] = []
        if self.file is not None:
            parts.append(self.file if self.line is None else f"{self.file}:{self.line}")
        if self.key is not None:
            parts.append(self.key)
        parts.append(self.message)
        return ": ".join(parts)


class ConfigErrors(ConfigError):
    """Several config errors at once (every one a file holds); ``errors`` in file order.

    Its own file, line, key and message are the first error's; :meth:`format` gives
    one line per error.
    """

    errors: list[ConfigError]

    def __init__(self, errors: list[ConfigError]) -> None:
        if not errors:
            raise ValueError("ConfigErrors needs at least one error")
        flat: list[ConfigError] = []
        for error in errors:
            flat.extend(error.errors if isinstance(error, ConfigErrors) else [error])
        self.errors = flat
        first = flat[0]
        super().__init__(first.message, file=first.file, line=first.line, key=first.key)

    def format(self) -> str:
        if not hasattr(self, "errors"):  # called by ConfigError.__init__ before errors is set
            return super().format()
        return "\n".join(error.format() for error in self.errors)

    @classmethod
    def raise_if_any(cls, errors: list[ConfigError]) -> None:
        """Raise the only error, or all of them as one ConfigErrors; nothing when the list is empty."""
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise cls(errors)


class UsageError(PulsarTapError):
    """A command was given bad arguments; printed as one line, exit status 2."""


class ClientError(PulsarTapError):
    """The built-in Pulsar client could not complete an operation."""


class BrokerError(ClientError):
    """A request refused with a ServerError: raised by the built-in client when the broker
    answers ERROR, SEND_ERROR or a failed lookup, and by the embedded broker to answer so.

    ``server_error`` is the ServerError name (e.g. ``"ConsumerBusy"``).
    """

    def __init__(self, server_error: str, message: str) -> None:
        super().__init__(f"{server_error}: {message}" if message else server_error)
        self.server_error = server_error
        self.message = message


class ConnectionFailed(ClientError):
    """A connection to a broker could not be opened or was lost."""


class RequestTimeout(ClientError):
    """A request, or a message's send receipt, did not arrive in time."""


class ClientClosed(ClientError):
    """The client, producer or consumer was closed while the operation waited."""

"""Payload compression exactly as Pulsar clients do it (MessageMetadata.compression).

- LZ4: a raw LZ4 *block* (no frame header, no stored size); the size to inflate to
  is MessageMetadata.uncompressed_size.
- ZLIB: a zlib stream (2-byte header, deflate data, Adler-32), as Java's Deflater and
  C++'s ``compress()`` write it.
- ZSTD: a zstd frame.
- SNAPPY: a raw snappy block (not the framing format).

Every library failure becomes a :class:`~proxy.errors.CompressionError`, and a
result whose length differs from ``uncompressed_size`` is an error too, as it is for
the clients.
"""

from __future__ import annotations

import zlib
from typing import Final

import cramjam

from proxy.errors import CompressionError
from proxy.pb import PulsarApi_pb2 as api

NONE: Final = api.NONE
LZ4: Final = api.LZ4
ZLIB: Final = api.ZLIB
ZSTD: Final = api.ZSTD
SNAPPY: Final = api.SNAPPY

#: CompressionType value -> name, e.g. 1 -> "LZ4"
NAMES: Final[dict[int, str]] = {v.number: v.name for v in api.CompressionType.DESCRIPTOR.values}
#: name -> CompressionType value
VALUES: Final[dict[str, int]] = {name: number for number, name in NAMES.items()}

#: Largest payload we agree to inflate; guards against decompression bombs.
MAX_UNCOMPRESSED_SIZE: Final = 512 * 1024 * 1024


def compression_name(kind: int) -> str:
    return NAMES.get(kind, f"UNKNOWN({kind})")


def compression_value(name: str) -> int:
    try:
        return VALUES[name.upper()]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(VALUES)}") from None


def compress(kind: int, data: bytes) -> bytes:
    """Compress ``data`` the way a Pulsar client does for compression type ``kind``."""
    try:
        if kind == NONE:
            return bytes(data)
        if kind == LZ4:
            return bytes(cramjam.lz4.compress_block(data, store_size=False))
        if kind == ZLIB:
            return zlib.compress(data)
        if kind == ZSTD:
            return bytes(cramjam.zstd.compress(data))
        if kind == SNAPPY:
            return bytes(cramjam.snappy.compress_raw(data))
    except (cramjam.CompressionError, zlib.error, ValueError, TypeError) as exc:
        raise CompressionError(f"{compression_name(kind)} compression failed: {exc}") from None
    raise CompressionError(f"unsupported compression type {kind}")


def decompress(kind: int, data: bytes, uncompressed_size: int) -> bytes:
    """Inflate a payload compressed with ``kind`` back to ``uncompressed_size`` bytes."""
    if kind == NONE:
        return bytes(data)
    if not 0 <= uncompressed_size <= MAX_UNCOMPRESSED_SIZE:
        raise CompressionError(f"implausible uncompressed size {uncompressed_size}")
    try:
        if kind == LZ4:
            out = bytes(cramjam.lz4.decompress_block(data, output_len=uncompressed_size))
        elif kind == ZLIB:
            inflater = zlib.decompressobj()
            out = inflater.decompress(data, uncompressed_size + 1)
        elif kind == ZSTD:
            out = bytes(cramjam.zstd.decompress(data, output_len=uncompressed_size))
        elif kind == SNAPPY:
            if cramjam.snappy.decompress_raw_len(data) != uncompressed_size:
                raise CompressionError("snappy block announces a different size than the metadata")
            out = bytes(cramjam.snappy.decompress_raw(data))
        else:
            raise CompressionError(f"unsupported compression type {kind}")
    except CompressionError:
        raise
    except (cramjam.DecompressionError, zlib.error, ValueError, TypeError, OverflowError) as exc:
        raise CompressionError(f"{compression_name(kind)} payload does not decompress: {exc}") from None
    if len(out) != uncompressed_size:
        raise CompressionError(f"{compression_name(kind)} payload inflates to {len(out)} bytes, "
                               f"metadata says {uncompressed_size}")
    return out

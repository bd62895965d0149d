"""Rows of frames of one size, read as numpy arrays: a field of every frame, compared at once.

A producer's frames mostly come in rows of one size.  The relay's scanner
(:mod:`proxy.core.scanner`) and the recorder's count of a dropped run's frames
(:mod:`proxy.core.run_cutter`) both look at such a row as one strided array per field
instead of frame by frame.
"""

from __future__ import annotations

import numpy


def column(data: bytes | memoryview, start: int, count: int, size: int, field: numpy.dtype | str) -> numpy.ndarray:
    """``field`` (a numpy type) of ``count`` frames of ``size`` bytes each, the first field at ``start``."""
    return numpy.ndarray((count,), field, data, start, (size,))


def leading_same(differs: numpy.ndarray) -> int:
    """How many entries come before the first true one of ``differs`` (all of them when none is)."""
    first = int(differs.argmax())
    return first if differs[first] else len(differs)


__all__ = ["column", "leading_same"]

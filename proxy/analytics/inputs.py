"""Where ``analyze`` reads and writes: local paths and Hadoop filesystem URLs.

A plain path (or ``file:`` path without a host) is read by the executors themselves,
split into byte ranges of about :data:`DEFAULT_SPLIT_BYTES`: it must be visible to
every executor at the same path (always so in local mode; on a cluster, a shared
mount).  A URL with a scheme (``hdfs://``, ``s3a://``, ``file:///`` to force it)
is read through Spark's ``binaryFile`` source, one segment per task, with whatever
filesystem jars the Spark installation has.  The same split applies to ``--out``.
Everything that can be checked before Spark starts is checked here, each failure a
one-line :class:`~proxy.analytics.spark.AnalyticsError`.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from proxy.errors import PulsarTapError

SEGMENT_GLOB: Final = "segment-*.ptap"
#: Byte ranges a local segment is cut into (a task each); small enough to spread 100 MiB over cores.
DEFAULT_SPLIT_BYTES: Final = 8 * 1024 * 1024


class AnalyticsError(PulsarTapError):
    """The analytics pipeline cannot run or its input cannot be read."""


def is_url(location: str) -> bool:
    """A Hadoop filesystem URL (read and written through Spark), as opposed to a local path."""
    return "://" in location


def resolve_inputs(paths: Sequence[str]) -> list[str]:
    """Local inputs checked and made absolute; URLs passed on as given."""
    resolved = []
    for raw in paths:
        if is_url(raw):
            resolved.append(raw)
            continue
        path = Path(raw)
        if not path.exists():
            raise AnalyticsError(f"{raw}: no such file or directory")
        if not path.is_dir():
            raise AnalyticsError(f"{raw}: not a recording directory")
        try:
            found = next(iter(path.rglob(SEGMENT_GLOB)), None)
        except OSError as exc:
            raise AnalyticsError(f"{raw}: cannot read: {exc.strerror or exc}") from None
        if found is None:
            raise AnalyticsError(f"{raw}: no recording here (no {SEGMENT_GLOB} files)")
        resolved.append(str(path.resolve()))
    return resolved


def check_output(out: str, inputs: Sequence[str] = ()) -> str:
    """``--out`` checked before any work: a directory that exists or can be made, and is writable.

    Returns the location to use (a local path made absolute, or the URL).
    """
    if is_url(out):
        return out
    path = Path(out).absolute()
    for existing in (path, *path.parents):
        if existing.exists():
            break
    else:  # pragma: no cover - the root always exists
        existing = Path("/")
    if not existing.is_dir():
        what = "is a file, not a directory" if existing == path else f"{existing} is not a directory"
        raise AnalyticsError(f"--out {out}: {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise AnalyticsError(f"--out {out}: {existing} is not writable")
    for raw in inputs:
        if not is_url(raw) and (path == Path(raw) or Path(raw) in path.parents):
            raise AnalyticsError(f"--out {out}: inside the recording {raw}; choose a directory outside it")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AnalyticsError(f"--out {out}: cannot create: {exc.strerror or exc}") from None
    return str(path)


def local_segments(inputs: Sequence[str]) -> list[tuple[str, str, str, int]]:
    """``(recording, segment name, path, size)`` of every segment under local inputs, in recording order."""
    found = []
    for root in inputs:
        for path in sorted(Path(root).rglob(SEGMENT_GLOB)):
            try:
                size = path.stat().st_size
            except OSError as exc:
                raise AnalyticsError(f"{path}: cannot read: {exc.strerror or exc}") from None
            found.append((path.parent.name, path.name, str(path), size))
    return found


@contextmanager
def mapped(path: str) -> Iterator[bytes | mmap.mmap]:
    """A segment file's bytes without reading them all: an mmap (empty files as ``b""``)."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, after the map
    except OSError as exc:
        raise AnalyticsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if os.fstat(handle.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
            yield view
    finally:
        handle.close()


__all__ = ["DEFAULT_SPLIT_BYTES", "SEGMENT_GLOB", "AnalyticsError", "check_output", "is_url", "local_segments",
           "mapped", "resolve_inputs"]

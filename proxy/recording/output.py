"""Output files of the recording commands: checked before the work, written whole or not at all.

:func:`check_output_file` is called before a command reads anything (``export
--pcap``, ``show --diagram``): the path must not be a directory, and its parent
must exist, be a directory and be writable, so a long read never ends in "cannot
write".  :func:`atomic_output` writes to a temporary name next to the target
(``.NAME.PID.tmp``) and renames it over the target only when the writing
succeeded; on any failure or interrupt the temporary file is removed and an
existing target is left as it was.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from proxy.errors import RecordingError, UsageError


def check_output_file(path: str | Path, flag: str) -> Path:
    """``path`` as a Path once it can be written; UsageError naming ``flag`` otherwise."""
    target = Path(path)
    if not str(path).strip():
        raise UsageError(f"{flag}: give a file name")
    if target.is_dir():
        raise UsageError(f"{flag}: {path} is a directory")
    parent = target.parent
    if not parent.exists():
        raise UsageError(f"{flag}: {path}: directory {parent} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{flag}: {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: {path}: cannot write in {parent} (permission denied)")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag}: {path}: permission denied")
    return target


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` only if the ``with`` block completes."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        handle = open(temporary, "wb")  # noqa: SIM115 - closed below, before the rename
    except OSError as exc:
        raise RecordingError(f"{path}: cannot write: {exc.strerror or exc}") from None
    try:
        with handle:
            yield handle
        os.replace(temporary, path)
    except OSError as exc:
        raise RecordingError(f"{path}: cannot write: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


__all__ = ["atomic_output", "check_output_file"]

"""Native libraries' own threads in pulsar-tap's processes: numpy's BLAS runs on one.

pulsar-tap does no linear algebra, but importing numpy starts OpenBLAS's thread pool, a
thread per core that spins ~30-40 ms of CPU while the process starts (measured: numpy's
import took 322 ms of process CPU against 218 on the importing thread; 114 / 114 with
one thread).  In the proxy that spin lands on the cores the relays need, and the observer
hub reads the process's other threads' CPU as its observers' (so telemetry was charged for
it at start); in the recording's writer process it was charged to the first write, which
then paused while the run ring filled.  The variables below must be set before numpy is
imported; a user's own setting wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

#: the settings that keep numpy's BLAS (OpenBLAS, or an OpenMP build) to the calling thread
ONE_THREAD_LIBRARIES: Final[Mapping[str, str]] = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def use_one_thread() -> None:
    """Set :data:`ONE_THREAD_LIBRARIES` in this process's environment where the user has not (call it before
    numpy is imported; its children inherit it)."""
    for name, value in ONE_THREAD_LIBRARIES.items():
        os.environ.setdefault(name, value)

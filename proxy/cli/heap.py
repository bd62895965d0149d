"""What a serving command does with the interpreter's heap once it has started.

What start-up built (modules, protobuf descriptors, the rules, the admin app: most of the heap) lives as
long as the process: frozen (``gc.freeze``), the full collections that traffic sets off skip it.  Without it
each full collection walked the whole start-up heap: a reconnect storm's were a tenth of the proxy's CPU, and
the embedded broker's, under 300 000 unbatched messages of the official client, ~0.7 s of its ~10 s (15
collections of ~45 ms each, the broker answering nothing meanwhile; settled: one of 17 ms).  Side by side
(bursts of 20 000 messages in turn), the settled broker took the official client's unbatched sends 1.06-1.12
times as fast, at 0.86-0.94 of the CPU a message.  A connection's or a request's objects
go when it does (few cycles among them): young collections every 700 allocations (Python's default) found
them alive and promoted them for nothing; every 10 000 they are rare, and short (~3 ms).
"""

from __future__ import annotations

import gc
from typing import Final

#: allocations (less deallocations) between two young collections once serving (Python's default: 700)
YOUNG_COLLECTION_OBJECTS: Final = 10_000


def settle_heap() -> None:
    """Freeze what start-up built and space the young collections out (see the module docstring); call once
    the command serves."""
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_OBJECTS, *gc.get_threshold()[1:])

"""The rule-file watcher task: poll a rule file and reload it when its content changes.

The Trio edge of :mod:`proxy.rules.reload`: every ``interval_s`` the file's digest
is read in a worker thread (a slow disk never stalls the loop), and
:meth:`~proxy.rules.reload.RuleFileWatch.saw` decides — on the Trio thread, where the
relays use the engine — whether the change is put in force.  Runs in the proxy's
services nursery (:mod:`proxy.server.stack`) until cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio

from proxy.rules.engine import RulesEngine
from proxy.rules.reload import RuleFileWatch


async def watch_rule_file(path: str | Path, engine: RulesEngine, interval_s: float = 1.0, *,
                          polled: Callable[[bool | None], None] | None = None) -> None:
    """Poll ``path`` forever (until cancelled), reloading it whenever its content changes.

    ``polled`` is told the outcome of every poll: None (unchanged or unreadable), True (the
    change was put in force) or False (the change was refused).
    """
    watch = RuleFileWatch(Path(path), engine)
    watch.start(await trio.to_thread.run_sync(watch.read_digest))
    while True:
        await trio.sleep(interval_s)
        outcome = watch.saw(await trio.to_thread.run_sync(watch.read_digest))
        if polled is not None:
            polled(outcome)


__all__ = ["watch_rule_file"]

"""Hot reload: watch a rule file and put a changed, valid version in force.

The file is polled (its size, mtime and finally its bytes) every ``interval_s``;
a change that loads cleanly replaces the engine's rules atomically
(:meth:`RulesEngine.replace` keeps the counters of unchanged rules), and an
invalid one is logged — every error, as ``FILE:LINE: KEY: message`` — while the
old rules stay in force.  This is the only part of :mod:`proxy.rules` that does
I/O; it runs as a task in the proxy's nursery.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import structlog
import trio

from proxy.errors import ConfigError
from proxy.rules.engine import RulesEngine
from proxy.rules.loader import load_rules_text

log = structlog.get_logger("pulsar_tap.rules")


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def reload_once(path: Path, engine: RulesEngine) -> bool:
    """Load ``path`` and put it in force; False (logged) when it is unreadable or invalid."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("rule file unreadable; keeping the old rules", file=str(path), reason=str(exc))
        return False
    try:
        ruleset = load_rules_text(text, str(path))
    except ConfigError as exc:
        log.warning("rule file invalid; keeping the old rules", file=str(path), errors=exc.format().splitlines())
        return False
    engine.replace(ruleset)
    log.info("rules reloaded", file=str(path), rules=len(ruleset.rules), seed=engine.seed)
    return True


async def watch_rule_file(path: str | Path, engine: RulesEngine, interval_s: float = 1.0, *,
                          polled: Callable[[bool | None], None] | None = None) -> None:
    """Poll ``path`` forever (until cancelled), reloading it whenever its content changes.

    ``polled`` is told the outcome of every poll: None (unchanged or unreadable), True (the
    change was put in force) or False (the change was refused).
    """
    rule_file = Path(path)
    seen = await trio.to_thread.run_sync(_digest, rule_file)
    while True:
        await trio.sleep(interval_s)
        current = await trio.to_thread.run_sync(_digest, rule_file)
        outcome: bool | None = None
        if current is not None and current != seen:
            seen = current
            outcome = reload_once(rule_file, engine)
        if polled is not None:
            polled(outcome)

"""Hot reload: put a changed, valid version of a watched rule file in force.

:class:`RuleFileWatch` remembers the content it last saw of a rule file (a SHA-256
of its bytes) and is shown the content found at each poll: a change that loads
cleanly replaces the engine's rules atomically (:meth:`RulesEngine.replace` keeps the
counters of unchanged rules), and an invalid one is logged — every error, as
``FILE:LINE: KEY: message`` — while the old rules stay in force.  It reads the file
but never waits and never schedules: the polling task, which reads the digest in a
worker thread every ``interval_s``, is :func:`proxy.server.rule_watch.watch_rule_file`
(the Trio edge).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import structlog

from proxy.errors import ConfigError
from proxy.rules.engine import RulesEngine
from proxy.rules.loader import load_rules_text

log = structlog.get_logger("pulsar_tap.rules")


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


class RuleFileWatch:
    """What a watcher of ``path`` knows: the content it last saw, and what to do with a change."""

    def __init__(self, path: Path, engine: RulesEngine) -> None:
        self.path = path
        self.engine = engine
        #: digest of the content last seen (None: not seen yet, or unreadable when first read)
        self.seen: str | None = None

    def read_digest(self) -> str | None:
        """The file's current content digest; None when it cannot be read.  Safe in a worker thread."""
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def start(self, digest: str | None) -> None:
        """The content in force when watching starts (already loaded): not a change."""
        self.seen = digest

    def saw(self, digest: str | None) -> bool | None:
        """One poll found ``digest``: None (unchanged or unreadable), True (the change was put
        in force) or False (the change was refused, logged).  Call it where the engine is used."""
        if digest is None or digest == self.seen:
            return None
        self.seen = digest
        return reload_once(self.path, self.engine)


__all__ = ["RuleFileWatch", "reload_once"]

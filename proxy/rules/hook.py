"""The rules engine as the proxy's :class:`~proxy.core.hooks.FrameHook`, and its record filter.

The engine's :class:`~proxy.rules.verdict.Verdict` goes to the relay as it is (one
decision type from engine to relay: a throttled SEND's ``lane`` holds only its
producer's or topic's SENDs, ``deferred`` FLOW permits are granted as the bucket
refills).  The relay tells the hook when a connection closes
(``connection_closed``), and the engine forgets its state.

``record`` rules: when the rule set has at least one, the recorder keeps only the
frames a record rule fired on (:func:`record_filter`, read live, so adding or
removing record rules at run time switches between "everything" and "only
matching frames").  Frames the proxy itself originates or changed carry no rule
names and are not kept in that mode.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.core.hooks import ConnectionInfo, FrameContext, FrameEvent
from proxy.core.interest import ConnectionInterest
from proxy.protocol.frame import Frame
from proxy.protocol.session import Direction, SessionTracker
from proxy.rules.engine import RulesEngine
from proxy.rules.verdict import Verdict


class RulesHook:
    """Feeds the relay's frames to a :class:`RulesEngine`."""

    def __init__(self, engine: RulesEngine) -> None:
        self.engine = engine

    @property
    def generation(self) -> int:
        """Changes with every change of the rules in force (and so of :meth:`interest`)."""
        return self.engine.generation

    def interest(self, direction: Direction) -> frozenset[int] | None:
        return self.engine.interest(direction)

    def connection_interest(self, direction: Direction, info: ConnectionInfo,
                            session: SessionTracker | None) -> ConnectionInterest:
        return self.engine.connection_interest(direction, info.conn_id, info.client, session)

    def on_frame(self, ctx: FrameContext, frame: Frame) -> Verdict:
        return self.engine.evaluate(frame, ctx.direction, ctx.now_ns, conn_id=ctx.connection.conn_id,
                                    client=ctx.connection.client, observation=ctx.observation)

    def connection_closed(self, conn_id: int) -> None:
        self.engine.connection_closed(conn_id)


def record_rule_names(engine: RulesEngine) -> frozenset[str]:
    return frozenset(state.rule.name for state in engine.states() if state.rule.action.RECORDS)


def record_filter(engine: RulesEngine) -> Callable[[FrameEvent], bool]:
    """The recorder's frame filter: everything, or only what a ``record`` rule fired on."""
    cache: dict[str, object] = {"generation": -1, "names": frozenset()}

    def keep(event: FrameEvent) -> bool:
        if cache["generation"] != engine.generation:
            cache["names"] = record_rule_names(engine)
            cache["generation"] = engine.generation
        names = cache["names"]
        assert isinstance(names, frozenset)
        if not names:
            return True
        return any(name in names for name in event.fired)

    return keep

"""The rules engine as the proxy's :class:`~proxy.server.hooks.FrameHook`, and its record filter.

Translates a :class:`~proxy.rules.verdict.Decision` (frames addressed by side) into
the relay's :class:`~proxy.server.hooks.Verdict` (frames addressed relative to the
sender).  ``lane`` passes through, so a throttled SEND holds only its producer's
(or topic's) SENDs; ``deferred`` frames become the verdict's ``later`` frames, so a
rationed FLOW passes the permits paid for now and the rest are granted as the
bucket refills, independent of the frame queue.  The relay tells the hook when a
connection closes (``connection_closed``), and the engine forgets its state.

``record`` rules: when the rule set has at least one, the recorder keeps only the
frames a record rule fired on (:func:`record_filter`, read live, so adding or
removing record rules at run time switches between "everything" and "only
matching frames").  Frames the proxy itself originates or changed carry no rule
names and are not kept in that mode.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.protocol.frame import Frame
from proxy.protocol.session import Direction
from proxy.rules.engine import RulesEngine
from proxy.rules.model import Record
from proxy.rules.verdict import Decision
from proxy.server.hooks import FORWARD, FrameContext, FrameEvent, Later, Verdict


def to_verdict(decision: Decision, direction: Direction) -> Verdict:
    """The relay's Verdict for ``decision`` on a frame travelling in ``direction``."""
    if not decision.changes_traffic and not decision.fired:
        return FORWARD
    to_broker = direction is Direction.TO_BROKER
    to_sender = decision.to_client if to_broker else decision.to_broker
    to_receiver = decision.to_broker if to_broker else decision.to_client
    later = tuple(Later(d.after_s, d.to_broker == to_broker, d.data) for d in decision.deferred)
    return Verdict(forward=decision.forward, replacement=decision.replacement, to_sender=to_sender,
                   to_receiver=to_receiver, delay_s=decision.delay_s, lane=decision.lane, later=later,
                   slice_bytes=decision.slice_bytes, close=decision.close, fired=decision.fired,
                   marks=decision.marks)


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

    def on_frame(self, ctx: FrameContext, frame: Frame) -> Verdict:
        decision = self.engine.evaluate(frame, ctx.direction, ctx.now_ns, conn_id=ctx.connection.conn_id,
                                        client=ctx.connection.client, observation=ctx.observation)
        return to_verdict(decision, ctx.direction)

    def connection_closed(self, conn_id: int) -> None:
        self.engine.connection_closed(conn_id)


def record_rule_names(engine: RulesEngine) -> frozenset[str]:
    return frozenset(state.rule.name for state in engine.states() if isinstance(state.rule.action, Record))


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

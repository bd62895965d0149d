"""The rules engine: one :class:`~proxy.rules.verdict.Verdict` per frame, from the rules in force.

Rules are evaluated in order (SPEC.md, "Rule language").  A rule *matches* a frame
when its criteria hold (see :mod:`proxy.rules.matcher`); its ``after`` skips that
many matches, its ``times`` caps its hits, and its ``probability`` is drawn per
frame from the rule's own ``random.Random``, seeded from the rule set's seed and
the rule's name — so the same seed and the same traffic give the same hits, and a
rule's draws do not shift when another rule is added.  The first *action-bearing*
rule that hits decides the frame (its action's :meth:`~proxy.rules.actions.Action.decide`);
``record`` and ``mark`` rules compose with it wherever they stand.  ``after`` and
``times`` count across all connections.

Rules are indexed by (direction, command type): a frame visits only the rules that
can match its kind, and which of those meet their criteria (topic, names, client) is
worked out once per distinct combination of those facts (:class:`_Candidates`), so
rules that do not match cost nothing per frame however many there are.

Per connection, the engine narrows what the relay must show it further
(:meth:`RulesEngine.connection_interest`): a frame of the data path (SEND, MESSAGE,
FLOW, ACK, receipts) is attributed to a topic and names only through its producer or
consumer id, so a rule whose topic or names fit none of the producers and consumers the
connection has registered cannot match it, and the relay passes those frames through
undecoded.  A registration (PRODUCER, SUBSCRIBE, a broker-given producer name) is a
*barrier*: the rest of its read is looked at whole, and the interest is asked again
before the next read.  A probability rule that needs nothing of the frame's contents
has its hits drawn before decoding (:mod:`proxy.rules.sampling`): only the frames it
fires on are decoded.  Which producers and consumers a connection ever registered is
kept as a set (a response may still name a closed one's topic), given up beyond
``_MAX_ENTITY_FACTS``.

State kept here: per rule, the match and hit counters, the generator and the
token buckets; per connection, the producers and consumers a ``close`` rule
unloaded (:mod:`proxy.rules.unload`: what is forwarded for them until the client
re-creates them, and the broker's answers to the proxy's own close requests).  :meth:`RulesEngine.replace`
swaps the rule set atomically and carries the state of every rule whose
definition did not change.  Time comes in as ``now_ns``; there is no clock, no
I/O and no trio here.
"""

from __future__ import annotations

import functools
import itertools
import random
import secrets
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Final

from proxy.core.interest import ConnectionInterest
from proxy.protocol.commands import DATA_PATH_TYPES, TYPE_NAMES, T
from proxy.protocol.frame import Frame
from proxy.protocol.session import Direction, Observation, SessionTracker
from proxy.rules import actions as acts
from proxy.rules.matcher import (
    CRITERIA_FACTS,
    ENTITY_CRITERIA,
    EntityFacts,
    FrameFacts,
    client_met,
    criteria_met,
    entity_met,
    host_of,
)
from proxy.rules.model import Rule, RuleSet
from proxy.rules.sampling import RuleSampler, SampleDraw
from proxy.rules.throttle import FairShare, TokenBucket
from proxy.rules.unload import UNLOAD_TYPES, ConnectionUnloads
from proxy.rules.verdict import FORWARD, Verdict

#: distinct fact combinations remembered per (direction, command type); then forgotten at once
_MAX_REMEMBERED_FACTS: Final = 4096
#: first request id of the close requests the proxy sends upstream (far above any client's)
PROXY_REQUEST_IDS_START: Final = 1 << 62
#: producers and consumers remembered per connection for its interest; beyond, it is not narrowed
_MAX_ENTITY_FACTS: Final = 1024
#: per-connection interest plans remembered (per distinct producers/consumers, client host, direction)
_MAX_PLANS: Final = 4096
#: the frames after which a connection's interest may grow, per direction (see the module docstring)
_REGISTRATIONS: Final = {Direction.TO_BROKER: frozenset({T.PRODUCER, T.SUBSCRIBE}),
                         Direction.TO_CLIENT: frozenset({T.PRODUCER_SUCCESS})}


def _hand_over_flow_shares(old: RuleState, new: RuleState | None) -> bool:
    """The FLOW permits ``old``'s throttle holds back, as its rule is replaced by ``new`` (None: removed).

    A user who loosens or tightens a throttle expects the permits it holds to follow the new
    rate, and one who removes it expects them to go: a replacing FLOW throttle with the same
    ``per`` (so the same buckets) takes the shares over at its rate; otherwise every lane's
    permits go out at its next poll (asked at once: ``permits_repaced``).  Whether ``old`` held any shares.
    """
    if not old.flow_shares:
        return False
    heir = _same_flow_buckets(old, new)
    for key, share in old.flow_shares.items():
        if heir is not None:
            state, throttle, rate = heir
            share.retune(rate, throttle.burst)
            state.flow_shares[key] = share
        else:
            share.release_all()
    old.flow_shares.clear()
    return True


def _same_flow_buckets(old: RuleState, new: RuleState | None) -> tuple[RuleState, acts.Throttle, float] | None:
    """``new``, its throttle and rate, when it paces the same consumers' FLOWs through the same buckets as ``old``."""
    before, after = old.rule.action, new.rule.action if new is not None else None
    if new is None or not isinstance(before, acts.Throttle) or not isinstance(after, acts.Throttle):
        return None
    if after.messages_per_second is None or after.per != before.per \
            or new.rule.match.direction == Direction.TO_CLIENT.value:
        return None
    return (new, after, after.messages_per_second) if new.commands is None or T.FLOW in new.commands else None


def choose_seed() -> int:
    """A fresh seed for a rule set without ``seed:`` (reported by GET /rules and the log)."""
    return secrets.randbelow(1 << 32)


@dataclass(eq=False)
class RuleState:
    """A rule with its counters, its generator and its buckets."""

    rule: Rule
    seed: int
    matches: int = 0
    hits: int = 0
    rng: random.Random = field(init=False)
    buckets: dict[Hashable, tuple[TokenBucket | None, TokenBucket | None]] = field(default_factory=dict)
    #: a FLOW throttle's buckets (keyed like :attr:`buckets`), each with the permits waiting for it
    flow_shares: dict[Hashable, FairShare] = field(default_factory=dict)
    commands: frozenset[int] | None = field(init=False)
    #: the action's per-frame exclusions (None: it has none, the common case costs nothing)
    skips: Callable[[FrameFacts], bool] | None = field(init=False)

    def __post_init__(self) -> None:
        self.reseed(self.seed)
        match = self.rule.match
        action = self.rule.action
        self.commands = match.commands if match.commands is not None else action.APPLIES_TO
        if match.markers is not None:  # markers travel only in SEND and MESSAGE
            self.commands = acts.MARKER_CARRIERS if self.commands is None else self.commands & acts.MARKER_CARRIERS
        self.skips = action.skips if type(action).skips is not acts.Action.skips else None

    def reseed(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(f"{seed}:{self.rule.name}")

    @property
    def names_entities(self) -> bool:
        """Does the rule read a topic, subscription or name (decided by a producer or consumer)?"""
        match = self.rule.match
        return any(getattr(match, criterion) is not None for criterion in ENTITY_CRITERIA)

    def can_fire_on(self, entities: frozenset[EntityFacts], host: Any) -> bool:
        """Can it still fire on a data-path frame of a connection with these producers and consumers?"""
        match = self.rule.match
        if match.probability <= 0.0 or (match.times is not None and self.hits >= match.times):
            return False
        if not client_met(match, host):
            return False
        return not self.names_entities or any(entity_met(match, facts) for facts in entities)

    @property
    def drawn_before_decoding(self) -> bool:
        """Can its hits be drawn before the frame is decoded (see proxy.rules.sampling)?"""
        match = self.rule.match
        return match.probability < 1.0 and self.skips is None and match.markers is None \
            and not self.names_entities and self.matches >= match.after


class _Candidates:
    """The rules that can match one (direction, command type), in order.

    Whether a rule's criteria hold depends only on the frame's facts that the criteria read
    (topic, subscription, producer/consumer name, client host), so the rules that meet them
    are remembered per combination of those facts; the counters are not criteria.
    """

    __slots__ = ("states", "facts", "remembered")

    def __init__(self, states: tuple[RuleState, ...]) -> None:
        self.states = states
        #: the facts any of these rules reads, in a fixed order
        self.facts = tuple(fact for criterion, fact in CRITERIA_FACTS
                           if any(getattr(state.rule.match, criterion) is not None for state in states))
        #: facts (the one fact's value, or a tuple of them) -> the rules meeting their criteria
        self.remembered: dict[Any, tuple[RuleState, ...]] = {}

    def meeting_criteria(self, facts: FrameFacts) -> tuple[RuleState, ...]:
        names = self.facts
        key: Any = getattr(facts, names[0]) if len(names) == 1 else tuple([getattr(facts, n) for n in names])
        met = self.remembered.get(key)
        if met is None:
            if len(self.remembered) >= _MAX_REMEMBERED_FACTS:
                self.remembered.clear()
            met = tuple(state for state in self.states if criteria_met(state.rule.match, state.commands, facts))
            self.remembered[key] = met
        return met


class RulesEngine:
    """Decides what happens to each frame; see the module docstring."""

    def __init__(self, ruleset: RuleSet | None = None, *, seed: int | None = None) -> None:
        ruleset = ruleset or RuleSet()
        chosen = ruleset.seed if ruleset.seed is not None else seed
        self.seed: int = chosen if chosen is not None else choose_seed()
        self.seed_from_file = ruleset.seed is not None
        self._states: tuple[RuleState, ...] = tuple(RuleState(rule, self.seed) for rule in ruleset.rules)
        self._connections: dict[int, ConnectionUnloads] = {}
        self._request_ids = itertools.count(PROXY_REQUEST_IDS_START)
        self._interest: dict[Direction, frozenset[int] | None] = {}
        #: per direction and command type, the rules that can match (evaluation skips the others)
        self._to_broker: dict[int, _Candidates] = {}
        self._to_client: dict[int, _Candidates] = {}
        self.generation = 0
        #: per connection, the producers and consumers it ever registered (None: too many to narrow by)
        self._entities: dict[int, set[EntityFacts] | None] = {}
        #: (direction, entities, client host) -> (types, sampled rules, sampled kinds, barrier), for one generation
        self._plans: dict[Any, tuple[frozenset[int], tuple[RuleState, ...], frozenset[int], frozenset[int]]] = {}
        self._plans_generation = -1
        self._samplers: dict[tuple[int, Direction], RuleSampler] = {}
        #: per connection, its session tracker (which consumers are open), as the relay last showed it
        self._sessions: dict[int, SessionTracker] = {}
        #: the verdicts of frames only ``mark`` / ``record`` rules fired on, by (record, fired, marks)
        self._noted: dict[tuple[bool, tuple[str, ...], tuple[str, ...]], Verdict] = {}
        #: told when a rule change let FLOW permits go or changed their pace (the relays ask their polls now)
        self.permits_repaced: Callable[[], None] | None = None
        self._compute_interest()

    # -- the rules in force ---------------------------------------------------------------------
    @property
    def rules(self) -> tuple[Rule, ...]:
        return tuple(state.rule for state in self._states)

    def states(self) -> Iterator[RuleState]:
        self.settle_deferred()
        return iter(self._states)

    def hits(self) -> dict[str, int]:
        self.settle_deferred()
        return {state.rule.name: state.hits for state in self._states}

    def settle_deferred(self, samplers: Iterable[RuleSampler | None] | None = None) -> None:
        """Count the picks that samplers (all, or ``samplers``) settled without telling the engine.

        Such a sampler's one rule has no ``times`` and its ``after`` is passed, so each pick is one
        match and one hit whenever it is counted (see _settle); they are counted before the counters
        are read (``states``, ``hits``) and before a sampler is dropped.
        """
        for sampler in self._samplers.values() if samplers is None else samplers:
            if sampler is not None and sampler.unsettled:
                state = sampler.states[0]
                state.matches += sampler.unsettled
                state.hits += sampler.unsettled
                sampler.unsettled = 0

    def _block_deferred(self, conn_id: int, blocked: bool) -> None:
        """Tell a connection's deferring samplers whether its picks can be settled (not while it unloads)."""
        for direction in (Direction.TO_BROKER, Direction.TO_CLIENT):
            sampler = self._samplers.get((conn_id, direction))
            if sampler is not None:
                sampler.blocked = blocked

    def replace(self, ruleset: RuleSet) -> None:
        """Put ``ruleset`` in force at once; unchanged rules keep their counters and buckets."""
        seed = ruleset.seed if ruleset.seed is not None else self.seed
        old = {state.rule.name: state for state in self._states}
        states: list[RuleState] = []
        repaced = False
        for rule in ruleset.rules:
            previous = old.pop(rule.name, None)
            if previous is not None and previous.rule == rule:
                previous.rule = rule  # the same definition; its line may have moved
                if previous.seed != seed:
                    previous.reseed(seed)
                states.append(previous)
            else:
                states.append(RuleState(rule, seed))
                if previous is not None:
                    repaced = _hand_over_flow_shares(previous, states[-1]) or repaced
        for gone in old.values():
            repaced = _hand_over_flow_shares(gone, None) or repaced
        self.seed = seed
        self.seed_from_file = self.seed_from_file or ruleset.seed is not None
        self._states = tuple(states)
        self._rules_changed()
        if repaced and self.permits_repaced is not None:
            self.permits_repaced()

    def add(self, rule: Rule) -> None:
        """Append one rule; raises ValueError when its name is taken."""
        if any(state.rule.name == rule.name for state in self._states):
            raise ValueError(f"a rule named {rule.name!r} already exists")
        self._states = (*self._states, RuleState(rule, self.seed))
        self._rules_changed()

    def remove(self, name: str) -> bool:
        """Remove the rule called ``name``; False when there is none."""
        kept = tuple(state for state in self._states if state.rule.name != name)
        if len(kept) == len(self._states):
            return False
        [gone] = [state for state in self._states if state.rule.name == name]  # (names are unique)
        repaced = _hand_over_flow_shares(gone, None)
        self._states = kept
        self._rules_changed()
        if repaced and self.permits_repaced is not None:
            self.permits_repaced()
        return True

    def _rules_changed(self) -> None:
        """A new rule set is in force: samplers draw anew (their deferred picks counted first), interest anew."""
        self.generation += 1
        self.settle_deferred()
        self._samplers.clear()
        self._compute_interest()

    def ruleset(self) -> RuleSet:
        return RuleSet(self.rules, self.seed)

    # -- what the relay must show us --------------------------------------------------------------
    def interest(self, direction: Direction) -> frozenset[int] | None:
        """Command types to hand to :meth:`evaluate` in ``direction``; None means every frame."""
        return self._interest.get(direction, frozenset())

    def _compute_interest(self) -> None:
        """Index the rules by direction and command type; the union is the relay's interest.

        The session tracker's own needs (the frames that attribute ids to topics) are the
        relay's business (``accounted_types``), not part of this interest.
        """
        for direction, index in ((Direction.TO_BROKER, self._to_broker), (Direction.TO_CLIENT, self._to_client)):
            in_direction = [s for s in self._states if s.rule.match.direction in ("any", direction.value)]
            index.clear()
            for kind in TYPE_NAMES:
                states = tuple(s for s in in_direction if s.commands is None or kind in s.commands)
                if states:
                    index[kind] = _Candidates(states)
            wanted: set[int] = set(index)
            # an unload follows the producer's or consumer's frames both ways (see unload.py),
            # also after the close rule that began it is gone
            if self._unloading():
                wanted |= UNLOAD_TYPES[direction]
            everything = any(s.commands is None for s in in_direction)
            self._interest[direction] = None if everything else frozenset(wanted)

    def connection_interest(self, direction: Direction, conn_id: int, client: str | None,
                            session: SessionTracker | None) -> ConnectionInterest:
        """What the relay must show of one connection in ``direction`` (see the module docstring)."""
        if self._plans_generation != self.generation:
            self._plans.clear()
            self._plans_generation = self.generation
        if session is not None:
            self._sessions[conn_id] = session
        entities = self._entity_facts(conn_id, session)
        host = host_of(client)
        key = (direction, entities, host)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = self._plan(direction, entities, host)
        types, sampled_states, sampled_kinds, barrier = plan
        sampler = None
        if sampled_states:
            sampler = self._samplers.get((conn_id, direction))
            if sampler is None or sampler.states != sampled_states or sampler.kinds != sampled_kinds:
                self.settle_deferred((sampler,))
                # rules that only take note of a hit can have it counted without the frame
                settle = functools.partial(self._settle, conn_id) \
                    if all(state.rule.action.COMPOSES for state in sampled_states) else None
                # (one such rule without times: its rows' picks are counted later, see settle_deferred)
                defer = settle is not None and len(sampled_states) == 1 and sampled_states[0].rule.match.times is None
                sampler = self._samplers[(conn_id, direction)] = RuleSampler(sampled_kinds, sampled_states, settle,
                                                                             defer=defer)
                unloads = self._connections.get(conn_id)
                sampler.blocked = unloads is not None and unloads.active
        return ConnectionInterest(types, sampler, barrier)

    def _entity_facts(self, conn_id: int, session: SessionTracker | None) -> frozenset[EntityFacts] | None:
        """The producers and consumers the connection ever registered; None when not known or too many."""
        if session is None:
            return None
        seen = self._entities.setdefault(conn_id, set())
        if seen is None:
            return None
        for producer in session.producers.values():
            seen.add((producer.topic, None, producer.producer_name or None, None))
        for consumer in session.consumers.values():
            seen.add((consumer.topic, consumer.subscription, None, consumer.consumer_name or None))
        if len(seen) > _MAX_ENTITY_FACTS:
            self._entities[conn_id] = None
            return None
        return frozenset(seen)

    def _plan(self, direction: Direction, entities: frozenset[EntityFacts] | None, host: Any,
              ) -> tuple[frozenset[int], tuple[RuleState, ...], frozenset[int], frozenset[int]]:
        """The frame types a connection's rules can fire on, and which of them a sampler draws for."""
        index = self._to_broker if direction is Direction.TO_BROKER else self._to_client
        types: set[int] = set()
        narrowed = False
        sampled: dict[int, tuple[RuleState, ...]] = {}
        for kind, candidates in index.items():
            if kind in DATA_PATH_TYPES and entities is not None:
                possible = tuple(s for s in candidates.states if s.can_fire_on(entities, host))
                narrowed = narrowed or len(possible) < len(candidates.states)
                if not possible:
                    continue
                if all(s.drawn_before_decoding for s in possible):
                    sampled[kind] = possible
            types.add(kind)
        if self._unloading():
            types |= UNLOAD_TYPES[direction]
            for kind in UNLOAD_TYPES[direction]:
                sampled.pop(kind, None)  # an unload looks at each of its producer's frames
        # one sampler per direction: the kinds whose rules are those of the first kind sampled
        group = next(iter(sampled.values()), ())
        sampled_kinds = frozenset(kind for kind, states in sampled.items() if states == group)
        return frozenset(types), group, sampled_kinds, _REGISTRATIONS[direction] if narrowed else frozenset()

    def _unloading(self) -> bool:
        return any(s.rule.action.UNLOADS for s in self._states) or \
            any(conn.active for conn in self._connections.values())

    # -- connections ------------------------------------------------------------------------------
    def connection_closed(self, conn_id: int) -> None:
        """Forget what was kept for one connection (its buckets with ``per: connection`` too)."""
        self._entities.pop(conn_id, None)
        self._sessions.pop(conn_id, None)
        for direction in (Direction.TO_BROKER, Direction.TO_CLIENT):
            self.settle_deferred((self._samplers.pop((conn_id, direction), None),))
        unloads = self._connections.pop(conn_id, None)
        if unloads is not None and unloads.active and not self._unloading():
            self.generation += 1  # the last unload is over: the relay may look at fewer frames again
            self._compute_interest()
        for state in self._states:
            for share in state.flow_shares.values():  # (a poll still held keeps its share: it must find its lane gone)
                for lane in [lane for lane in share.lanes if isinstance(lane, tuple) and lane[0] == conn_id]:
                    share.drop(lane)
            for kept in (state.buckets, state.flow_shares):  # (keyed (per, conn_id, ...) per connection or consumer)
                for key in [k for k in kept if isinstance(k, tuple) and len(k) > 1 and k[1] == conn_id]:
                    del kept[key]

    # -- the decision -----------------------------------------------------------------------------
    def evaluate(self, frame: Frame, direction: Direction, now_ns: int, *, conn_id: int = 0,
                 client: str | None = None, observation: Observation | None = None) -> Verdict:
        """What to do with ``frame``, travelling in ``direction``, on connection ``conn_id``."""
        unloads = self._connections.get(conn_id)
        if unloads is not None:
            unloaded = unloads.on_frame(frame, direction)
            self._block_deferred(conn_id, unloads.active)
            if unloaded is not None:
                return unloaded
        index = self._to_broker if direction is Direction.TO_BROKER else self._to_client
        rules = index.get(frame.type)
        if rules is None:
            return FORWARD
        facts = FrameFacts(frame, direction, observation, client)
        candidates = rules.meeting_criteria(facts)
        if not candidates:
            return FORWARD
        draw = frame.draw if isinstance(frame.draw, SampleDraw) else None
        winner: Verdict | None = None
        fired: list[str] = []
        marks: list[str] = []
        record = False
        for state in candidates:
            action = state.rule.action
            if winner is not None and not action.COMPOSES:
                continue
            if state.skips is not None and state.skips(facts):
                continue
            if not self._hits(state, draw):
                continue
            if action.COMPOSES:
                fired.append(state.rule.name)
                record = record or action.RECORDS
                label = action.mark(state.rule.name)
                if label is not None:
                    marks.append(label)
                continue
            verdict = action.decide(state, facts, now_ns, conn_id, self)
            if verdict is None:
                state.hits -= 1  # the action turned out not to apply to this frame
                continue
            fired.append(state.rule.name)
            winner = verdict
        if not fired:
            return FORWARD
        if winner is None:  # only rules that take note fired: the same few verdicts again and again
            key = (record, tuple(fired), tuple(marks))
            noted = self._noted.get(key)
            if noted is None:
                if len(self._noted) >= _MAX_REMEMBERED_FACTS:
                    self._noted.clear()
                noted = self._noted[key] = Verdict(record=record, fired=key[1], marks=key[2])
            return noted
        return replace(winner, record=record, fired=tuple(fired), marks=tuple(marks))

    def _hits(self, state: RuleState, draw: SampleDraw | None) -> bool:
        """Does a rule whose criteria are met (its action's exclusions too) hit this frame?

        That is: after, times, probability.  Where a sampler drew for the rule before the
        frame was decoded (``draw``), its draw stands in for the per-frame one.
        """
        match = state.rule.match
        state.matches += 1
        if state.matches <= match.after:
            if state.matches == match.after:
                self.generation += 1  # from the next match on, its draws may be made before decoding
            return False
        if match.times is not None and state.hits >= match.times:
            return False
        if draw is not None and state in draw.rules:
            if state not in draw.due:
                return False
        elif match.probability < 1.0 and state.rng.random() >= match.probability:
            return False
        state.hits += 1
        if match.times is not None and state.hits >= match.times:
            self.generation += 1  # it cannot fire again: the relay may look at fewer frames
        return True

    def _settle(self, conn_id: int, draw: SampleDraw, picks: int) -> bool:
        """``picks`` of a sampler's picks on ``conn_id``, all with the note ``draw``, that nobody observes,
        for rules that only take note (see ``sampling``): count their hits as :meth:`evaluate` would, one
        pick after the other, without the frames (True).

        Such a pick's frame could fire no other rule (the sampler's are the only ones that can
        fire on this connection's frames of its kinds), and its verdict would leave the frame
        unchanged; but while the connection unloads a producer or consumer, its frames are
        looked at (False).  With ``picks`` 0 it only tells which.
        """
        unloads = self._connections.get(conn_id)
        if unloads is not None and unloads.active:
            return False
        if not picks:
            return True
        for state in draw.due:
            match = state.rule.match
            if picks == 1 or state.matches < match.after:
                for _ in range(picks):
                    self._hits(state, draw)
                continue
            # as many calls of _hits, past ``after``, for a rule the draw says is due
            state.matches += picks
            if match.times is None:
                state.hits += picks
            elif state.hits < match.times:
                state.hits = min(match.times, state.hits + picks)
                if state.hits >= match.times:
                    self.generation += 1  # it cannot fire again: the relay may look at fewer frames
        return True

    # -- what actions ask of the engine -----------------------------------------------------------
    def consumer_alive(self, conn_id: int, consumer_id: int, observation: Observation | None) -> Callable[[], bool]:
        """Is the consumer a frame on ``conn_id`` was attributed to still open (not closed, not re-created)?"""
        session = self._sessions.get(conn_id)
        consumer = observation.consumer if observation is not None else None
        if session is None or consumer is None:
            return lambda: True  # not known: until its connection closes
        consumers = session.consumers
        return lambda: consumers.get(consumer_id) is consumer

    def permits_held(self, conn_id: int) -> dict[int, int]:
        """FLOW permits a throttle holds back per consumer of ``conn_id``: granted by the client, not yet sent on."""
        held: dict[int, int] = {}
        for state in self._states:
            for share in state.flow_shares.values():
                for lane, waiting in share.lanes.items():
                    if isinstance(lane, tuple) and lane[0] == conn_id:
                        held[lane[1]] = held.get(lane[1], 0) + waiting.owed + waiting.paid
        return held

    def begin_unload(self, rule: str, frame: Frame, conn_id: int) -> bytes | None:
        """Begin unloading the producer or consumer of ``frame`` (see unload.py).

        Returns the close request for the broker; None when ``frame`` names no producer or
        consumer, or when that one is already being unloaded.
        """
        request_id = next(self._request_ids)
        close = acts.close_frames(frame, request_id)
        if close is None:
            return None
        kind, entity_id, to_client, upstream = close
        unloads = self._connections.setdefault(conn_id, ConnectionUnloads())
        if unloads.phase(kind, entity_id) is not None:
            return None  # already being unloaded
        was_unloading = self._unloading()
        unloads.begin(kind, entity_id, request_id, to_client, rule)
        self._block_deferred(conn_id, True)
        if not was_unloading:
            self.generation += 1
            self._compute_interest()
        return upstream

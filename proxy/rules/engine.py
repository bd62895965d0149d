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

State kept here: per rule, the match and hit counters, the generator and the
token buckets; per connection, the producers and consumers a ``close`` rule
unloaded (:mod:`proxy.rules.unload`: what is forwarded for them until the client
re-creates them, and the broker's answers to the proxy's own close requests).  :meth:`RulesEngine.replace`
swaps the rule set atomically and carries the state of every rule whose
definition did not change.  Time comes in as ``now_ns``; there is no clock, no
I/O and no trio here.
"""

from __future__ import annotations

import itertools
import random
import secrets
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Final

from proxy.protocol.commands import TYPE_NAMES
from proxy.protocol.frame import Frame
from proxy.protocol.session import Direction, Observation
from proxy.rules import actions as acts
from proxy.rules.matcher import CRITERIA_FACTS, FrameFacts, criteria_met
from proxy.rules.model import Rule, RuleSet
from proxy.rules.throttle import TokenBucket
from proxy.rules.unload import UNLOAD_TYPES, ConnectionUnloads
from proxy.rules.verdict import FORWARD, Verdict

#: distinct fact combinations remembered per (direction, command type); then forgotten at once
_MAX_REMEMBERED_FACTS: Final = 4096
#: first request id of the close requests the proxy sends upstream (far above any client's)
PROXY_REQUEST_IDS_START: Final = 1 << 62


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
        self._compute_interest()

    # -- the rules in force ---------------------------------------------------------------------
    @property
    def rules(self) -> tuple[Rule, ...]:
        return tuple(state.rule for state in self._states)

    def states(self) -> Iterator[RuleState]:
        return iter(self._states)

    def hits(self) -> dict[str, int]:
        return {state.rule.name: state.hits for state in self._states}

    def replace(self, ruleset: RuleSet) -> None:
        """Put ``ruleset`` in force at once; unchanged rules keep their counters and buckets."""
        seed = ruleset.seed if ruleset.seed is not None else self.seed
        old = {state.rule.name: state for state in self._states}
        states: list[RuleState] = []
        for rule in ruleset.rules:
            previous = old.get(rule.name)
            if previous is not None and previous.rule == rule:
                previous.rule = rule  # the same definition; its line may have moved
                if previous.seed != seed:
                    previous.reseed(seed)
                states.append(previous)
            else:
                states.append(RuleState(rule, seed))
        self.seed = seed
        self.seed_from_file = self.seed_from_file or ruleset.seed is not None
        self._states = tuple(states)
        self.generation += 1
        self._compute_interest()

    def add(self, rule: Rule) -> None:
        """Append one rule; raises ValueError when its name is taken."""
        if any(state.rule.name == rule.name for state in self._states):
            raise ValueError(f"a rule named {rule.name!r} already exists")
        self._states = (*self._states, RuleState(rule, self.seed))
        self.generation += 1
        self._compute_interest()

    def remove(self, name: str) -> bool:
        """Remove the rule called ``name``; False when there is none."""
        kept = tuple(state for state in self._states if state.rule.name != name)
        if len(kept) == len(self._states):
            return False
        self._states = kept
        self.generation += 1
        self._compute_interest()
        return True

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

    def _unloading(self) -> bool:
        return any(s.rule.action.UNLOADS for s in self._states) or \
            any(conn.active for conn in self._connections.values())

    # -- connections ------------------------------------------------------------------------------
    def connection_closed(self, conn_id: int) -> None:
        """Forget what was kept for one connection (its buckets with ``per: connection`` too)."""
        unloads = self._connections.pop(conn_id, None)
        if unloads is not None and unloads.active and not self._unloading():
            self.generation += 1  # the last unload is over: the relay may look at fewer frames again
            self._compute_interest()
        for state in self._states:
            for key in [k for k in state.buckets if isinstance(k, tuple) and len(k) > 1 and k[1] == conn_id]:
                del state.buckets[key]

    # -- the decision -----------------------------------------------------------------------------
    def evaluate(self, frame: Frame, direction: Direction, now_ns: int, *, conn_id: int = 0,
                 client: str | None = None, observation: Observation | None = None) -> Verdict:
        """What to do with ``frame``, travelling in ``direction``, on connection ``conn_id``."""
        unloads = self._connections.get(conn_id)
        if unloads is not None:
            unloaded = unloads.on_frame(frame, direction)
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
        winner: Verdict | None = None
        fired: list[str] = []
        marks: list[str] = []
        record = False
        for state in candidates:
            action = state.rule.action
            if winner is not None and not action.COMPOSES:
                continue
            if not self._hits(state, facts):
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
        return replace(winner or FORWARD, record=record, fired=tuple(fired), marks=tuple(marks))

    @staticmethod
    def _hits(state: RuleState, facts: FrameFacts) -> bool:
        """Does a rule whose criteria are met hit this frame (after, times, probability)?"""
        match = state.rule.match
        if state.skips is not None and state.skips(facts):
            return False
        state.matches += 1
        if state.matches <= match.after:
            return False
        if match.times is not None and state.hits >= match.times:
            return False
        if match.probability < 1.0 and state.rng.random() >= match.probability:
            return False
        state.hits += 1
        return True

    # -- what actions ask of the engine -----------------------------------------------------------
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
        if not was_unloading:
            self.generation += 1
            self._compute_interest()
        return upstream

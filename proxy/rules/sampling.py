"""Probability rules drawn before decoding: which frames of a connection they can fire on.

A rule with ``probability`` p < 1 and no criterion that needs the frame's contents
(no topic, subscription or names, no markers, no per-frame exclusions of its action,
its ``after`` passed) fires on each frame of its command types independently with
chance p (SPEC.md, "Rule language").  Instead of a draw per frame, which needs the
frame decoded and shown to the engine, the number of frames to pass before its next
hit is drawn at once: a geometric count, ``floor(log(U) / log(1 - p))`` for U uniform
in (0, 1] (one draw of the rule's own seeded generator per hit).  That is the same
distribution — each frame hit with chance p, independently of every other — so the
rate is unchanged and a seeded run is reproducible, but the *sequence* of frames hit
for a given seed is not the one the per-frame draws gave.

:class:`RuleSampler` is the :class:`~proxy.core.scanner.Sampler` of one connection and
direction: the scanner counts the frames of its kinds as they arrive and hands out
only the frames on which one of its rules comes due, each with a :class:`SampleDraw`
naming those rules; frames of its kinds handed out for another reason carry
:attr:`RuleSampler.passed` (none due).  The engine then fires exactly the rules due.
When nobody observes the connection and the rules due only take note of a hit (``mark``,
``record``: the frame passes unchanged, and only their counters tell), the engine
counts the hits at the pick (``settle``) and the frame passes through undecoded, in its
run; the draws, and so the frames hit for a seed, are the same either way.  In a row of
frames of one size the scanner checks at once, the picks are settled in one call
(``settle_row``): with one rule, the engine is asked once whether picks can be settled
now (a settle of none), then the row's picks are drawn in one loop and counted together.
No clock, no I/O here.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from proxy.rules.engine import RuleState

#: the gap of a rule that never fires (probability 0)
NEVER: Final = sys.maxsize
#: the least double whose int() exceeds NEVER (2**63, the next double above it)
_BEYOND_NEVER: Final = float(NEVER + 1)


def geometric_gap(rng: random.Random, probability: float) -> int:
    """Frames to pass before the next one hit, when each is hit with ``probability``."""
    if probability >= 1.0:
        return 0
    if probability <= 0.0:
        return NEVER
    return _gap(rng.random(), math.log1p(-probability))


def _gap(uniform: float, log_miss: float) -> int:
    """The gap a uniform draw in [0, 1) stands for, ``log_miss`` being log(1 - probability)."""
    return min(NEVER, int(math.log(1.0 - uniform) / log_miss))


class SampleDraw:
    """A sampler's note on a frame it counted: its rules, and those of them that hit this frame."""

    __slots__ = ("rules", "due")

    def __init__(self, rules: frozenset[RuleState], due: frozenset[RuleState]) -> None:
        self.rules = rules
        self.due = due


class RuleSampler:
    """The draws of some probability rules over one connection's frames of ``kinds`` in one direction."""

    def __init__(self, kinds: frozenset[int], states: tuple[RuleState, ...],
                 settle: Callable[[SampleDraw, int], bool] | None = None, *, defer: bool = False) -> None:
        self.kinds = kinds
        self.states = states
        #: counts the hits of some picks with the same note without their frames, if it can (True; asked
        #: about 0 picks, it only tells whether it can); None: it never can.  (The engine refuses only
        #: while the connection unloads, which begins only at a frame it looks at.)
        self._settle = settle
        self.passed = SampleDraw(frozenset(states), frozenset())
        #: the common case, one rule: the note of every frame it picks
        self._alone = SampleDraw(self.passed.rules, self.passed.rules) if len(states) == 1 else None
        probability = states[0].rule.match.probability if len(states) == 1 else 0.0
        #: the one rule's log(1 - p), as geometric_gap divides by it, when its picks can be settled in rows
        self._per_frame = math.log1p(-probability) if settle is not None and 0.0 < probability < 1.0 else None
        #: that rule's generator (the engine makes new samplers whenever it reseeds one: the rules changed)
        self._random: Callable[[], float] = states[0].rng.random
        #: per rule, frames to pass before its next hit
        self._gaps: list[int] = []
        #: ``defer`` (the engine's, for one rule without ``times``): the picks of a row are counted here,
        #: in ``unsettled``, and the engine adds them to the rule's counters before anyone reads them
        #: (:meth:`~proxy.rules.engine.RulesEngine.settle_deferred`); it sets ``blocked`` while it
        #: could not settle them (the connection unloads), instead of being asked at every row
        self.defers = defer and self._per_frame is not None
        self.unsettled = 0
        self.blocked = False

    def _draw(self, state: RuleState) -> int:
        return geometric_gap(state.rng, state.rule.match.probability)

    def start(self) -> int:
        self._gaps = [self._draw(state) for state in self.states]
        return min(self._gaps)

    def choose(self) -> tuple[SampleDraw, int]:
        if self._alone is not None:
            gap = self._gaps[0] = self._draw(self.states[0])
            return self._alone, gap
        passed = min(self._gaps)
        due: list[RuleState] = []
        for index, state in enumerate(self.states):
            gap = self._gaps[index]
            if gap == passed:
                due.append(state)
                self._gaps[index] = self._draw(state)
            else:
                self._gaps[index] = gap - passed - 1
        return SampleDraw(self.passed.rules, frozenset(due)), min(self._gaps)

    def settle(self) -> tuple[SampleDraw | None, int]:
        draw, gap = self.choose()
        if self._settle is not None and self._settle(draw, 1):
            return None, gap
        return draw, gap

    def settle_row(self, skip: int, count: int) -> tuple[int, SampleDraw | None, int]:
        if skip >= count:
            return count, None, skip - count
        log_miss = self._per_frame
        if log_miss is None:
            return self.settle_each(skip, count)
        # One rule whose picks can be settled: asked once whether they can be now (see _settle),
        # its picks in the row are drawn here, in order, as choose() draws them, and counted at once
        # (or left for the engine to count, see ``defers``).
        assert self._settle is not None and self._alone is not None
        if self.blocked if self.defers else not self._settle(self._alone, 0):
            draw, gap = self.choose()
            return skip, draw, gap
        # (compiled, the loop runs on C doubles: math.log is libm's log, as the interpreter's is,
        # and int() truncates as it does; typed so, a pick costs a call of the generator and a log)
        random = self._random
        at, picks, gap, quotient = skip, 0, 0, 0.0
        while at < count:  # (each gap as _gap draws it; only the last can exceed NEVER: it ends the row)
            uniform: float = random()
            quotient = math.log(1.0 - uniform) / log_miss
            gap = int(quotient)
            picks += 1
            at += gap + 1
        if quotient >= _BEYOND_NEVER:  # (gap > NEVER, compared as doubles: compiled, NEVER is boxed)
            at -= gap - NEVER
            gap = NEVER
        self._gaps[0] = gap
        if self.defers:
            self.unsettled += picks
        else:
            self._settle(self._alone, picks)
        return count, None, at - count

    def settle_each(self, skip: int, count: int) -> tuple[int, SampleDraw | None, int]:
        """:meth:`settle_row` the general way: each pick of the row settled alone, in order."""
        at = skip
        while True:
            draw, gap = self.settle()
            if draw is not None:
                return at, draw, gap
            at += gap + 1
            if at >= count:
                return count, None, at - count

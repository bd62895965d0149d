"""A row of picks settled at once draws and counts exactly as picks settled one by one.

:meth:`RuleSampler.settle_row` has a lane of its own for one rule whose picks can be
settled: it asks the engine once whether they can be now, draws every pick of the row in
one loop and has them counted in one call.  The general path settles pick after pick
(:meth:`RuleSampler.settle_each`).  For any probability, seed, ``times``, row and refusal,
both must end where the other does: the same answer, the same hits and matches on the
rule, the same generation, and the rule's generator at the same point.

The module runs compiled (mypyc, on C doubles): its draws must be the source's, draw for draw.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import compiled
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.session import Direction, SessionTracker
from proxy.rules import sampling
from proxy.rules.engine import RulesEngine, RuleState
from proxy.rules.loader import load_rules_text
from proxy.rules.sampling import RuleSampler

T = api.BaseCommand.Type


def one_rule_engine(probability: float, seed: int, times: int | None) -> tuple[RulesEngine, RuleSampler]:
    """An engine with one ``mark`` rule drawn before decoding, and its sampler of one connection's SENDs."""
    extra = f", times: {times}" if times is not None else ""
    engine = RulesEngine(load_rules_text(
        f"seed: {seed}\nrules:\n  - name: sampled\n"
        f"    match: {{command: [SEND], probability: {probability:.12f}{extra}}}\n    action: mark\n"))
    interest = engine.connection_interest(Direction.TO_BROKER, 1, "127.0.0.1:5555", SessionTracker(strict=False))
    assert isinstance(interest.sampler, RuleSampler) and interest.sampler.kinds == frozenset({T.SEND})
    return engine, interest.sampler


@settings(max_examples=300, deadline=None)
@given(probability=st.sampled_from([1e-9, 0.001, 0.01, 0.2, 0.5, 0.9, 0.999]),
       seed=st.integers(0, 2**32 - 1), times=st.none() | st.integers(1, 40),
       rows=st.lists(st.tuples(st.integers(1, 3000), st.booleans()), min_size=1, max_size=12))
def test_a_row_settled_at_once_draws_and_counts_as_its_picks_settled_one_by_one(
        probability: float, seed: int, times: int | None, rows: list[tuple[int, bool]]) -> None:
    fast_engine, fast = one_rule_engine(probability, seed, times)
    slow_engine, slow = one_rule_engine(probability, seed, times)
    skip_fast = skip_slow = fast.start()
    assert slow.start() == skip_fast
    counts = {fast: fast._settle, slow: slow._settle}  # (the engines' own: count the picks, if they can)
    for count, refuse in rows:
        for sampler, settle in counts.items():  # refusing, as the engine does while the connection unloads
            sampler._settle = (lambda draw, picks: False) if refuse else settle
            sampler.blocked = refuse  # (how a sampler that defers its counts is told)
        if skip_fast >= count:  # (the scanner asks only about rows that hold a pick)
            skip_fast = skip_slow = skip_fast - count
            continue
        at, draw, gap = fast.settle_row(skip_fast, count)
        expected = slow.settle_each(skip_slow, count)
        assert (at, gap) == expected[::2] and (draw is None) == (expected[1] is None)
        if draw is not None:
            assert expected[1] is not None
            assert [s.rule.name for s in draw.due] == [s.rule.name for s in expected[1].due]
        skip_fast = skip_slow = gap
        fast_state, slow_state = next(fast_engine.states()), next(slow_engine.states())
        assert (fast_state.hits, fast_state.matches) == (slow_state.hits, slow_state.matches)
        assert fast_engine.generation == slow_engine.generation
        assert fast_state.rng.getstate() == slow_state.rng.getstate()


def sampling_source() -> ModuleType:
    """proxy/rules/sampling.py run by the interpreter (as another module), whatever the tree runs."""
    path = Path(sampling.__file__).with_name("sampling.py")
    spec = importlib.util.spec_from_file_location("sampling_as_source", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not compiled.is_compiled(module)
    return module


def test_the_compiled_draws_are_the_sources_draw_for_draw() -> None:
    """A seed hits the same frames compiled as interpreted: every gap geometric_gap draws, and every row
    settle_row draws (where it stops, the gap after it, the picks it counts, the generator after it)."""
    source = sampling_source()
    for probability in (1e-9, 1e-4, 0.001, 0.01, 0.2, 0.5, 0.9, 0.999):
        rule = load_rules_text(f"rules:\n  - name: sampled\n    match: {{command: [SEND], probability: "
                               f"{probability:.12f}}}\n    action: mark\n").rules[0]
        for seed in range(20):
            ours, theirs = random.Random(seed), random.Random(seed)
            assert [sampling.geometric_gap(ours, probability) for _ in range(300)] == \
                [source.geometric_gap(theirs, probability) for _ in range(300)]
            states = [RuleState(rule, seed) for _ in range(2)]
            fast = sampling.RuleSampler(frozenset({T.SEND}), (states[0],), lambda draw, picks: True, defer=True)
            slow = source.RuleSampler(frozenset({T.SEND}), (states[1],), lambda draw, picks: True, defer=True)
            skip = fast.start()
            assert slow.start() == skip
            rows = random.Random(seed)
            for _ in range(40):
                count = rows.randint(1, 2000)
                if skip >= count:
                    skip -= count
                    continue
                at, draw, gap = fast.settle_row(skip, count)
                assert (at, draw, gap) == slow.settle_row(skip, count)
                assert fast.unsettled == slow.unsettled
                assert states[0].rng.getstate() == states[1].rng.getstate()
                skip = gap

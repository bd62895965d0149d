"""A Playbook for :class:`~proxy.core.pipeline.ConnectionPipeline`: events in, the exact actions out.

After mitmproxy's proxy-core tests: a test writes the conversation as it should happen,

    assert Playbook(pipeline) >> Receive(TO_BROKER, CONNECT) << OpenUpstream(UPSTREAM) << Send(TO_BROKER, CONNECT)

and the playbook feeds each event to the pipeline in order and compares every action it
returned with the ones written, in order and all of them: an action nobody wrote down (a
``Close``, a ``Hold``, one more ``Send``) fails the test, as does one that did not come.
``Send`` is compared by direction, the bytes it carries (however they were split) and
its slice size.  No sockets, no clock: times are the events' ``now_ns``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.core.pipeline import Action, ConnectionPipeline, Send
from proxy.protocol.session import Direction


@dataclass(frozen=True)
class Receive:
    """Bytes read from one side (``direction`` is where they travel)."""

    direction: Direction
    data: bytes
    now_ns: int = 0


@dataclass(frozen=True)
class Tick:
    now_ns: int


@dataclass(frozen=True)
class ReleaseDue:
    now_ns: int


Event = Receive | Tick | ReleaseDue


def _normal(action: Any) -> Any:
    if isinstance(action, Send):
        return ("Send", action.direction, b"".join(bytes(piece) for piece in action.data), action.slice_bytes)
    return action


@dataclass
class Playbook:
    pipeline: ConnectionPipeline
    _script: list[tuple[str, Any]] = field(default_factory=list)

    def __rshift__(self, event: Event) -> Playbook:
        self._script.append((">>", event))
        return self

    def __lshift__(self, action: Action) -> Playbook:
        self._script.append(("<<", action))
        return self

    def _run(self, event: Event) -> list[Action]:
        if isinstance(event, Receive):
            return self.pipeline.receive(event.direction, event.data, event.now_ns)
        if isinstance(event, Tick):
            return self.pipeline.tick(event.now_ns)
        return self.pipeline.release_due(event.now_ns)

    def __bool__(self) -> bool:
        """Play the script; raises AssertionError at the first difference, naming the event."""
        last: Event | None = None
        actual: list[Any] = []
        expected: list[Any] = []
        for kind, item in [*self._script, (">>", None)]:
            if kind == "<<":
                expected.append(_normal(item))
                continue
            if last is not None and actual != expected:
                raise AssertionError(f"after {last!r}:\n  expected {expected!r}\n  got      {actual!r}")
            if item is None:
                return True
            last, expected = item, []
            actual = [_normal(action) for action in self._run(item)]
        return True

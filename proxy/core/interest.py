"""What a hook must see of one connection: the frame types, a sampler, the barrier types.

The rules engine narrows the frames the relay decodes for it per connection (a rule
scoped to a topic cannot fire on a connection with no producer or consumer on it) and
draws some rules' hits before decoding; :class:`ConnectionInterest` is how it says so,
and :class:`Sampler` is what the :class:`~proxy.core.scanner.FrameScanner` asks which
frames of the sampled types to hand out.  (Its own module: the scanner, the hooks and
the rules engine all use it.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol


class Sampler(Protocol):
    """Picks the frames of :attr:`kinds` to hand out, counting them in the order they arrive."""

    @property
    def kinds(self) -> frozenset[int]:
        """The command types it picks from."""
        ...

    @property
    def passed(self) -> object:
        """The note on frames of those types handed out without being picked (wanted anyway)."""
        ...

    def start(self) -> int:
        """How many frames of its kinds to pass over before it picks one."""
        ...

    def choose(self) -> tuple[object, int]:
        """A frame was picked: its note, and how many frames to pass over before the next pick."""
        ...

    def settle(self) -> tuple[object | None, int]:
        """A frame was picked that nothing but the sampler asks to see, and nobody observes.

        As :meth:`choose`, except that when what the pick means can be settled without
        the frame (its rules only take note of a hit: counted here), the note is None
        and the frame passes through like those passed over.
        """
        ...

    def settle_row(self, skip: int, count: int) -> tuple[int, object | None, int]:
        """``count`` frames of its kinds pass in a row, nobody observes them, and the next pick is
        the one at index ``skip`` (less than ``count``): :meth:`settle` each pick in the row, in order.

        Returns where the row stops: ``(count, None, skip)`` when every pick was settled (``skip``:
        frames after the row to pass over before the next pick); otherwise the index of the first
        pick that was not, its note, and the frames after it to pass over.
        """
        ...


@dataclass(frozen=True, slots=True)
class ConnectionInterest:
    """What a hook must see of one connection in one direction.

    ``types``: the command types shown to ``on_frame`` (None: every frame).  Of the
    ``sampler``'s kinds (a subset of ``types``) the scanner hands out only the frames the
    sampler picks, noting on each it hands out whether it was picked (``Frame.draw``);
    when nobody observes the connection, a pick the sampler settles itself is not handed
    out at all (:meth:`Sampler.settle`).
    ``barrier``: frames after which the interest may grow (the rest of their read is looked
    at whole; the interest is asked again before the next).
    """

    types: frozenset[int] | None
    sampler: Sampler | None = None
    barrier: frozenset[int] = frozenset()

    @property
    def sampled_kinds(self) -> frozenset[int]:
        return self.sampler.kinds if self.sampler is not None else frozenset()


#: a hook that wants nothing
NO_INTEREST: Final = ConnectionInterest(frozenset())

"""Points in time as users write them for ``show --since/--until``.

Accepted forms:

- ISO 8601: ``2026-11-22T10:00:00Z``, ``2026-11-22 10:00:00.250+01:00``; UTC when
  no offset is given (the timeline prints UTC);
- Unix seconds: ``1763805600`` or ``1763805600.25``;
- relative to now: ``-5m``, ``-90s``, ``-1h30m`` (also ``5m ago``);
- relative to the first frame of the recording: ``+30s``, ``+2m``.

Units: ``ms``, ``s``, ``m``, ``h``, ``d``.  Nothing here reads a clock: "now" is
passed in, so parsing is a pure function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from proxy.errors import UsageError

_UNIT_NS: Final = {"ms": 1_000_000, "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000,
                   "d": 86_400_000_000_000}
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


@dataclass(frozen=True, slots=True)
class Moment:
    """An absolute time (Unix epoch ns), or an offset from the recording's first frame."""

    ns: int
    from_start: bool = False

    def resolve(self, start_ns: int) -> int:
        return start_ns + self.ns if self.from_start else self.ns


def _duration_ns(text: str) -> int | None:
    position, total = 0, 0.0
    for match in _DURATION.finditer(text):
        if match.start() != position:
            return None
        total += float(match[1]) * _UNIT_NS[match[2]]
        position = match.end()
    return int(total) if position == len(text) and text else None


def parse_moment(text: str, now_ns: int, flag: str = "--since") -> Moment:
    """Parse one of the forms of the module docstring; UsageError naming ``flag`` otherwise."""
    value = text.strip()
    lowered = value.lower()
    if lowered.endswith(" ago"):
        lowered = "-" + lowered[:-4].strip()
    if lowered[:1] in "+-" and (duration := _duration_ns(lowered[1:].replace(" ", ""))) is not None:
        return Moment(duration, from_start=True) if lowered[0] == "+" else Moment(now_ns - duration)
    try:
        return Moment(int(float(value) * 1e9))
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise UsageError(f"{flag}: bad time {text!r}: use ISO 8601 (2026-11-22T10:00:00Z), Unix seconds, "
                         "-5m (before now) or +30s (after the first frame)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return Moment(int(moment.timestamp() * 1e9))


__all__ = ["Moment", "parse_moment"]

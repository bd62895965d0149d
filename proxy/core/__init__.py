"""The proxy's sans-IO core: what the relay does with each connection's bytes, without I/O.

- :mod:`~proxy.core.hooks` — the contract with plug-ins: the rules hook asked about
  frames (its :class:`~proxy.rules.verdict.Verdict` carried out as it is), observers
  fed :class:`~proxy.core.hooks.FrameEvent` s and :class:`~proxy.core.hooks.RunEvent` s;
- :mod:`~proxy.core.pipeline` — one connection's state: bytes in, actions out (send,
  open the upstream, hold, follow a redirect, close);
- :mod:`~proxy.core.scanner` — the header scanner that passes frames through as bytes
  and hands over only the frames someone wants;
- :mod:`~proxy.core.lookup` — broker URLs rewritten in lookup answers;
- :mod:`~proxy.core.holding` — frames held back by delays and throttles;
- :mod:`~proxy.core.run_cutter` — whole frames back out of runs of passed-through bytes.

None of it imports Trio; :mod:`proxy.server` is the Trio layer that moves the bytes.
Rules, recording and telemetry depend on this package, never on :mod:`proxy.server`.
"""

from pathlib import Path as _Path

from proxy import compiled as _compiled

#: Modules scripts/setup.sh compiles with mypyc (proxy.compiled), in the relay's lane: the pipeline and the header
#: scanner run on every relayed read.
COMPILED_MODULES = ("pipeline", "scanner")
_compiled.guard(__name__, _Path(__file__).parent, COMPILED_MODULES, _compiled.RELAY_LANE)

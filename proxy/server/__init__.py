"""The proxy's Trio layer: listeners, per-connection relays, upstream connections, observers' task.

The per-connection logic is sans-IO and lives in :mod:`proxy.core` (pipeline, scanner,
lookup rewriting, holding, the hook/observer contract); ``transport``, ``upstream``,
``relay`` and ``app`` move bytes, own sockets and timers, and carry the pipeline's
actions out.  The tasks of the proxy's other parts are here too, their logic beside
it: ``recorder`` (queue and writer task; encoding and files in
:mod:`proxy.recording.writer`) and ``rule_watch`` (the polling task; reload decisions in
:mod:`proxy.rules.reload`).  ``stack`` is the one place rules, recording, telemetry and
the admin API are wired to the server.  ``hop`` (what the reactor does per relayed read) and
``plain_socket`` (a plain socket's calls that never wait) run compiled, in the relay's lane
(:data:`proxy.compiled.RELAY_LANE`: one extension with the pipeline and the scanner).
"""

from pathlib import Path as _Path

from proxy import compiled as _compiled

#: Modules scripts/setup.sh compiles with mypyc (proxy.compiled), in the relay's lane: the reactor's hop runs on
#: every relayed read.
COMPILED_MODULES = ("hop", "plain_socket")
_compiled.guard(__name__, _Path(__file__).parent, COMPILED_MODULES, _compiled.RELAY_LANE)

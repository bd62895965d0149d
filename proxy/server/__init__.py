"""The proxy's Trio layer: listeners, per-connection relays, upstream connections, observers' task.

The per-connection logic is sans-IO and lives in :mod:`proxy.core` (pipeline, scanner,
lookup rewriting, holding, the hook/observer contract); ``transport``, ``upstream``,
``relay`` and ``app`` move bytes, own sockets and timers, and carry the pipeline's
actions out.  The tasks of the proxy's other parts are here too, their logic beside
it: ``recorder`` (queue and writer task; encoding and files in
:mod:`proxy.recording.writer`) and ``rule_watch`` (the polling task; reload decisions in
:mod:`proxy.rules.reload`).  ``stack`` is the one place rules, recording, telemetry and
the admin API are wired to the server.
"""

"""The proxy's Trio layer: listeners, per-connection relays, upstream connections, observers' task.

The per-connection logic is sans-IO and lives in :mod:`proxy.core` (pipeline, scanner,
lookup rewriting, holding, the hook/observer contract); ``transport``, ``upstream``,
``relay`` and ``app`` move bytes, own sockets and timers, and carry the pipeline's
actions out; ``stack`` wires rules, recording, telemetry and the admin API to them.
"""

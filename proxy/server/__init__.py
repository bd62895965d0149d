"""The proxy: listeners, per-connection relays, upstream connections and lookup rewriting.

The per-connection logic (``pipeline``, ``scanner``, ``lookup``, ``keepalive``) is
sans-IO; ``transport``, ``upstream``, ``relay`` and ``app`` are the thin Trio layer
that moves bytes, owns sockets and timers, and carries the pipeline's actions out.
"""

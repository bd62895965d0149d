"""Replay of recorded Pulsar sessions: broker-side (answer a live client from a recording)
and client-side (re-enact the recorded clients against a broker and diff the answers).

Sans-IO (no trio):

- :mod:`proxy.replay.conversation` — a recording as its clients saw it: requests, answers, outcomes;
- :mod:`proxy.replay.matcher` — recorded answers indexed by command and key fields, id remapping;
- :mod:`proxy.replay.served` — one live connection answered from the recording;
- :mod:`proxy.replay.routes` — ``--unmatched forward``'s routing table and failure answers;
- :mod:`proxy.replay.client_side` — client-side replay's step order, account and diff.

The Trio edge (sockets, tasks, timers):

- :mod:`proxy.replay.server` — the server for ``replay --serve``;
- :mod:`proxy.replay.forward` — ``--unmatched forward`` over the built-in client's connections;
- :mod:`proxy.replay.replayer` — client-side replay against a live broker.

A recording proxy and a replay server on threads, for scripts and tests, are in
:mod:`proxy.testing.rig` (the test-suite API).
"""

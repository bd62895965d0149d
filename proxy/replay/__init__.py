"""Replay of recorded Pulsar sessions: broker-side (answer a live client from a recording)
and client-side (re-enact the recorded clients against a broker and diff the answers).

- :mod:`proxy.replay.conversation` — a recording as its clients saw it: requests, answers, outcomes;
- :mod:`proxy.replay.matcher` — recorded answers indexed by command and key fields, id remapping;
- :mod:`proxy.replay.served` — one live connection answered from the recording (sans-IO);
- :mod:`proxy.replay.server` — the Trio server for ``replay --serve``;
- :mod:`proxy.replay.forward` — ``--unmatched forward``;
- :mod:`proxy.replay.replayer` — client-side replay and its diff.

A recording proxy and a replay server on threads, for scripts and tests, are in
:mod:`proxy.testing.rig` (the test-suite API).
"""

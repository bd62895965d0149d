"""pulsar-tap in your own tests: the public Python API (import everything from here).

::

    from proxy.testing import Tap, error, delay

    with Tap() as tap:                                  # an embedded cluster behind a proxy
        client = pulsar.Client(tap.service_url)
        with tap.inject(error("ServiceNotReady").on("PRODUCER").times(2)) as fault:
            producer = client.create_producer("orders")   # retried by the client, succeeds third time
        assert fault.hits == 2
        with tap.recording() as rec:
            producer.send(b"hello")
        assert len(rec.frames("SEND", topic="orders")) == 1

- :class:`Tap` — a proxy in front of a service URL or an embedded cluster, in this
  process or a child process (:mod:`proxy.testing.tap`);
- :class:`AdminClient` — a running proxy's admin API (:mod:`proxy.testing.admin_client`);
- fault builders — :func:`delay`, :func:`error`, :func:`drop`, :func:`disconnect`,
  :func:`close`, :func:`unload`, :func:`throttle`, ... and Toxiproxy's
  :func:`latency`, :func:`timeout`, :func:`reset_peer`, :func:`bandwidth`,
  :func:`slicer` (:mod:`proxy.testing.faults`, which documents the mapping);
- :class:`Capture` — what ``tap.recording()`` returns (:mod:`proxy.testing.capture`);
- :class:`EmbeddedCluster` — in-memory brokers (:mod:`proxy.testing.cluster`);
- :class:`Cassette` — record a test's traffic once, replay it broker-side after
  (:mod:`proxy.testing.cassette`);
- :mod:`proxy.testing.rig` — ``RecordingProxy`` and ``ThreadedReplayServer``: a recording
  proxy and a broker-side replay server, each on a Trio loop of its own thread, for
  scripts and tests that drive blocking clients (cassettes use them; import them from there).

The pytest plugin (``proxy.pytest_plugin``, registered as ``pulsar_tap``) builds
fixtures on these; ``tests/examples/README.md`` of the project shows both in use.
"""

from proxy.testing.admin_client import AdminClient, RuleStatus
from proxy.testing.capture import Capture, CapturedFrame, CapturedRequest
from proxy.testing.cassette import RECORD_MODES, Cassette
from proxy.testing.cluster import EmbeddedCluster
from proxy.testing.errors import (
    AdminError,
    AdminUnauthorized,
    AdminUnreachable,
    InvalidRule,
    RuleConflict,
    RuleNotFound,
    TapError,
)
from proxy.testing.faults import (
    Fault,
    bandwidth,
    close,
    corrupt,
    delay,
    disconnect,
    drop,
    duplicate,
    error,
    latency,
    mark,
    record,
    redirect,
    reset_peer,
    rewrite,
    slice_frames,
    slicer,
    throttle,
    timeout,
    unload,
)
from proxy.testing.injection import Injection
from proxy.testing.tap import Tap

__all__ = [
    "RECORD_MODES", "AdminClient", "AdminError", "AdminUnauthorized", "AdminUnreachable", "Capture",
    "CapturedFrame", "CapturedRequest", "Cassette", "EmbeddedCluster", "Fault", "Injection", "InvalidRule",
    "RuleConflict", "RuleNotFound", "RuleStatus", "Tap", "TapError", "bandwidth", "close", "corrupt", "delay",
    "disconnect", "drop", "duplicate", "error", "latency", "mark", "record", "redirect", "reset_peer", "rewrite",
    "slice_frames", "slicer", "throttle", "timeout", "unload",
]

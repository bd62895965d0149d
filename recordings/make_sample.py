"""Make the sample recording ``recordings/sample/``: the official client through the proxy.

Starts the embedded broker and a recording pulsar-tap proxy in front of it (both
in-process, on loopback ports chosen by the OS), lets the official
``pulsar-client`` subscribe, produce MESSAGES messages (batching on, LZ4, keys and
properties) and consume and acknowledge them all, stops the proxy so that the
recording is finished, and moves the recording to ``recordings/sample/``
(replacing what was there).

    .venv/bin/python recordings/make_sample.py [--messages N] [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster
from proxy.testing.rig import RecordingProxy, official_session

HERE = Path(__file__).resolve().parent

TOPIC = "persistent://public/default/sample-orders"
SUBSCRIPTION = "sample-sub"


def make_sample(out: Path, messages: int) -> Path:
    cluster = ThreadedCluster(ClusterConfig(brokers=1)).start()
    try:
        with tempfile.TemporaryDirectory() as parent:
            with RecordingProxy(cluster.service_url, parent) as proxy:
                official_session(proxy.service_url, TOPIC, SUBSCRIPTION, messages)
                recording = proxy.recording_path
            if out.exists():
                shutil.rmtree(out)
            shutil.move(str(recording), out)
    finally:
        cluster.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--out", type=Path, default=HERE / "sample")
    args = parser.parse_args()
    out = make_sample(args.out, args.messages)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

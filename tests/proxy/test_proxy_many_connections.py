"""A thousand connections carrying traffic at once through one proxy process (issue #12).

The proxy and the embedded broker run as ``pulsar-tap`` processes; this test opens
1 000 client connections and holds them all open, then every one creates a producer
and sends a burst of messages at the same time as the others.  Every message must be
acknowledged; the proxy's resident memory while all of them are busy must stay within
a bound per connection; and once they are closed the proxy's file descriptors must
come back to what it had before.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import FrameDecoder, encode_command, encode_payload_command

CONNECTIONS = 1000
MESSAGES = 10
#: resident memory the proxy may add per open, busy connection (measured: ~30 KiB)
RSS_PER_CONNECTION = 150 * 1024


def _soak_module():  # type: ignore[no-untyped-def]
    """bench/soak.py: its process launcher and /proc sampling serve this test too."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
    spec = importlib.util.spec_from_file_location("pulsar_tap_soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = _soak_module()


def rss_bytes(pid: int) -> int:
    rss: int = soak.proc_status(pid)[0]
    return rss


def open_fds(pid: int) -> int:
    fds: int = soak.proc_status(pid)[1]
    return fds


async def one_client(index: int, port: int, all_open: trio.Event, opened: list[int],
                     receipts: list[int]) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    decoder = FrameDecoder()

    async def next_frames() -> list:  # type: ignore[type-arg]
        while True:
            data = await stream.receive_some(65536)
            assert data, f"connection {index} closed by the proxy"
            frames = decoder.receive(data)
            if frames:
                return frames

    async with stream:
        await stream.send_all(encode_command(api.CommandConnect(client_version=f"many-{index}", protocol_version=21)))
        assert (await next_frames())[0].type == api.BaseCommand.CONNECTED
        opened.append(index)
        if len(opened) == CONNECTIONS:
            all_open.set()
        await all_open.wait()  # every connection is open before any sends
        topic = f"persistent://public/default/many-{index % 50}"
        await stream.send_all(encode_command(api.CommandProducer(topic=topic, producer_id=1, request_id=1)))
        assert (await next_frames())[0].type == api.BaseCommand.PRODUCER_SUCCESS
        burst = b"".join(encode_payload_command(
            api.CommandSend(producer_id=1, sequence_id=seq), api.MessageMetadata(
                producer_name=f"many-{index}", sequence_id=seq, publish_time=1), b"m" * 200) for seq in range(MESSAGES))
        await stream.send_all(burst)
        got = 0
        while got < MESSAGES:
            got += sum(1 for f in await next_frames() if f.type == api.BaseCommand.SEND_RECEIPT)
        receipts.append(got)


@pytest.fixture
def enough_fds() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 16384)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))  # the proxy and broker inherit it
    if wanted < 3 * CONNECTIONS:
        pytest.skip(f"the file descriptor limit ({hard}) is below what 1 000 proxied connections need")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_thousand_busy_connections_are_all_served_in_bounded_memory(tmp_path: Path, enough_fds: None) -> None:
    with soak.pulsar_tap(tmp_path, "broker", "broker", "--listen", "127.0.0.1:0") as (_, broker, _), \
            soak.pulsar_tap(tmp_path, "proxy", "run", "--upstream", f"pulsar://{broker}", "--listen", "127.0.0.1:0",
                       "--drain-seconds", "0") as (proxy, listen, _):
        port = int(listen.rsplit(":", 1)[1])
        time.sleep(0.5)
        fds_before, rss_before = open_fds(proxy.pid), rss_bytes(proxy.pid)
        peak = {"rss": rss_before, "fds": fds_before}
        opened: list[int] = []
        receipts: list[int] = []

        async def main() -> None:
            all_open = trio.Event()

            async def sample() -> None:
                while True:
                    peak["rss"] = max(peak["rss"], rss_bytes(proxy.pid))
                    peak["fds"] = max(peak["fds"], open_fds(proxy.pid))
                    await trio.sleep(0.2)

            with trio.fail_after(240):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sample)
                    async with trio.open_nursery() as clients:
                        for index in range(CONNECTIONS):
                            clients.start_soon(one_client, index, port, all_open, opened, receipts)
                            if index % 100 == 99:
                                await trio.sleep(0.05)  # the kernel's accept backlog
                    nursery.cancel_scope.cancel()

        trio.run(main)
        assert len(opened) == CONNECTIONS and receipts == [MESSAGES] * CONNECTIONS
        # both sides of every connection were open at once in the proxy
        assert peak["fds"] >= fds_before + 2 * CONNECTIONS
        grown = peak["rss"] - rss_before
        assert grown < CONNECTIONS * RSS_PER_CONNECTION, f"the proxy grew {grown / 2**20:.0f} MiB"
        deadline = time.monotonic() + 30
        while open_fds(proxy.pid) > fds_before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_fds(proxy.pid) == fds_before
        print(f"\n1000 connections: proxy RSS {rss_before / 2**20:.0f} -> peak {peak['rss'] / 2**20:.0f} MiB "
              f"({grown / CONNECTIONS / 1024:.0f} KiB per connection); fds {fds_before} -> peak {peak['fds']} "
              f"-> {open_fds(proxy.pid)}")

"""``pulsar-tap export``: a recording as a capture file Wireshark and tshark open."""

from __future__ import annotations

import argparse

NAME = "export"
HELP = "export a recording as a pcapng capture"
DESCRIPTION = """\
Write a recording as pcapng: each recorded connection becomes one TCP
conversation between its recorded client and broker addresses, with the
recorded capture times, real IPv4/TCP headers and checksums.  Payload bytes
that were not recorded are zero-filled so frame sizes stay true.  REC is a
recording directory or a parent of several.

examples:
  pulsar-tap export recordings/20260101T120000Z-4242 --pcap session.pcapng
  tshark -r session.pcapng -q -z conv,tcp
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", metavar="REC", help="recording directory, or a parent of several")
    parser.add_argument("--pcap", metavar="OUT.pcapng", required=True, help="the capture file to write")


def run(args: argparse.Namespace) -> int:
    from proxy.recording.export import export_pcap

    summary = export_pcap(args.recording, args.pcap)
    print(f"{args.pcap}: {summary.connections} connections, {summary.frames} frames, {summary.packets} packets")
    return 0

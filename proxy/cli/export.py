"""``pulsar-tap export``: a recording as a capture file Wireshark and tshark open."""

from __future__ import annotations

import argparse
import sys

from proxy.wording import counted

NAME = "export"
HELP = "export a recording as a pcapng capture"
DESCRIPTION = """\
Write a recording as pcapng: each recorded connection becomes one TCP
conversation between its recorded client and broker addresses, with the
recorded capture times, real IPv4/TCP headers and checksums.  Payload bytes
that were not recorded are zero-filled so frame sizes stay true.  REC is a
recording directory or a parent of several.

The output path is checked before anything is read; the capture is written
under a temporary name and renamed into place once complete, so a failure or an
interrupt never leaves a partial file.  Damaged records of the recording are
skipped (a warning on stderr says which).

examples:
  pulsar-tap export recordings/20260101T120000Z-4242 --pcap session.pcapng
  tshark -r session.pcapng -q -z conv,tcp
"""
EPILOG = """\
exit status:
  0    the capture was written (a warning says what a damaged recording lost)
  2    bad arguments, no recording at REC, an output path that cannot be written
  130  interrupted by SIGINT/SIGTERM: nothing was written
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", metavar="REC", help="recording directory, or a parent of several")
    parser.add_argument("--pcap", metavar="OUT.pcapng", required=True,
                        help="the capture file to write (replaced if it exists)")


def run(args: argparse.Namespace) -> int:
    from proxy.cli.interrupt import EXIT_INTERRUPTED, stop_requests
    from proxy.recording.export import export_pcap

    try:
        # a signal asks the writer to stop between two packets; once the file is renamed into place it is complete
        with stop_requests() as should_stop:
            summary = export_pcap(args.recording, args.pcap, should_stop=should_stop)
    except KeyboardInterrupt:
        print(f"pulsar-tap export: interrupted: {args.pcap} not written", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"{args.pcap}: {counted(summary.connections, 'connection')}, {counted(summary.frames, 'frame')}, "
          f"{counted(summary.packets, 'packet')}")
    warning = summary.report.summary()
    if warning:
        print(f"pulsar-tap export: warning: {warning}", file=sys.stderr)
    return 0

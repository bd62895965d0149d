"""``pulsar-tap show``: a recording as a readable timeline, JSON Lines, or a sequence diagram."""

from __future__ import annotations

import argparse

NAME = "show"
HELP = "print the decoded timeline of a recording (or follow a live one)"
DESCRIPTION = """\
Print every recorded frame in capture-time order: time (UTC), connection,
direction (C->B client to broker, B->C broker to client, P->B / P->C changed or
sent by the proxy), command, topic, ids, size, latency to the matching request,
and the rules that fired.  Colours are used when stdout is a terminal.  REC is a
recording directory or a parent of several.

Filters combine (a frame must pass all); list-valued ones take several values
separated by commas or repeated.  Topics may be short names as the broker reads
them (orders = persistent://public/default/orders, partitions included) or globs.
Times (--since/--until) are ISO 8601 (UTC unless an offset is given), Unix
seconds, -5m (before now) or +30s (after the recording's first frame).

--follow prints frames as the running proxy records them (tail -f style): on a
recording directory until the proxy finishes it, on a parent directory the
newest recording and every newer one, until SIGINT/SIGTERM.  Earlier frames are
read (for topics and latencies) but printed only with --since.

A damaged recording is read around the damage: every intact record is shown,
and one warning line on stderr says what was skipped (with --json, also a last
line {"problems": [...], ...}).

examples:
  pulsar-tap show recordings/20260101T120000Z-4242
  pulsar-tap show recordings/ --command SEND,SEND_RECEIPT --topic 'orders-*'
  pulsar-tap show REC --conn 3 --json | jq .fields
  pulsar-tap show REC --since 2026-01-01T12:00:00Z --until +90s --request-id 7
  pulsar-tap show REC --producer-name 'standalone-0-*' --sequence-id 41,42
  pulsar-tap show recordings/ --follow --command ERROR,SEND_ERROR
  pulsar-tap show REC --diagram session.html
"""
EPILOG = """\
exit status:
  0    printed (also when stopped by SIGINT/SIGTERM, or by a closed pipe such as | head)
  2    bad arguments, no recording at REC, a --diagram path that cannot be written
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", metavar="REC", help="recording directory, or a parent of several")
    parser.add_argument("--json", action="store_true", help="print JSON Lines, one object per frame")
    parser.add_argument("--diagram", metavar="OUT.html",
                        help="also write a sequence diagram (self-contained HTML) of the shown frames")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="keep printing frames as the running proxy records them (tail -f style)")
    parser.add_argument("--conn", metavar="N", action="append", default=[],
                        help="only these connection ids (repeat or separate with commas)")
    parser.add_argument("--topic", metavar="GLOB", action="append", default=[],
                        help="only frames about a topic matching GLOB; short names as the broker reads them "
                             "(repeatable)")
    parser.add_argument("--command", dest="commands", metavar="NAME", action="append", default=[],
                        help="only these command types, e.g. SEND,SEND_RECEIPT (repeatable)")
    parser.add_argument("--since", metavar="TIME",
                        help="only frames at or after TIME (ISO 8601, Unix seconds, -5m, +30s)")
    parser.add_argument("--until", metavar="TIME", help="only frames before TIME (same forms as --since)")
    parser.add_argument("--request-id", dest="request_ids", metavar="N", action="append", default=[],
                        help="only requests and responses with these request_id values (repeatable)")
    parser.add_argument("--producer-name", dest="producer_names", metavar="GLOB", action="append", default=[],
                        help="only frames of producers whose name matches GLOB: PRODUCER, SEND, receipts, "
                             "and MESSAGEs they published (repeatable)")
    parser.add_argument("--sequence-id", dest="sequence_ids", metavar="N", action="append", default=[],
                        help="only SEND / SEND_RECEIPT / SEND_ERROR with these sequence_id values (repeatable)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="colourise the timeline (default: auto, when stdout is a terminal)")


def run(args: argparse.Namespace) -> int:
    from proxy.recording.show import ShowOptions, show

    options = ShowOptions.from_args(
        conns=args.conn, topics=args.topic, commands=args.commands, json=args.json,
        diagram=args.diagram, color=args.color, since=args.since, until=args.until,
        request_ids=args.request_ids, producer_names=args.producer_names, sequence_ids=args.sequence_ids,
        follow=args.follow)
    return show(args.recording, options)

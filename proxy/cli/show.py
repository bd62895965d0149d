"""``pulsar-tap show``: a recording as a readable timeline, JSON Lines, or a sequence diagram."""

from __future__ import annotations

import argparse

NAME = "show"
HELP = "print the decoded timeline of a recording"
DESCRIPTION = """\
Print every recorded frame in capture-time order: time, connection, direction
(C->B client to broker, B->C broker to client, P->B / P->C changed or sent by the
proxy), command, topic, ids, size, latency to the matching request, and the rules
that fired.  Colours are used when stdout is a terminal.  REC is a recording
directory or a parent of several.

examples:
  pulsar-tap show recordings/20260101T120000Z-4242
  pulsar-tap show recordings/ --command SEND,SEND_RECEIPT --topic 'persistent://public/default/orders-*'
  pulsar-tap show REC --conn 3 --json | jq .fields
  pulsar-tap show REC --diagram session.html
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", metavar="REC", help="recording directory, or a parent of several")
    parser.add_argument("--json", action="store_true", help="print JSON Lines, one object per frame")
    parser.add_argument("--diagram", metavar="OUT.html",
                        help="also write a sequence diagram (self-contained HTML) of the shown frames")
    parser.add_argument("--conn", metavar="N", action="append", default=[],
                        help="only these connection ids (repeat or separate with commas)")
    parser.add_argument("--topic", metavar="GLOB", action="append", default=[],
                        help="only frames about a topic matching GLOB (repeatable)")
    parser.add_argument("--command", dest="commands", metavar="NAME", action="append", default=[],
                        help="only these command types, e.g. SEND,SEND_RECEIPT (repeatable)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="colourise the timeline (default: when stdout is a terminal)")


def run(args: argparse.Namespace) -> int:
    from proxy.recording.show import ShowOptions, show

    options = ShowOptions.from_args(
        conns=args.conn, topics=args.topic, commands=args.commands, json=args.json,
        diagram=args.diagram, color=args.color)
    return show(args.recording, options)

"""``pulsar-tap demo``: the main job on embedded defaults.

Until the proxy and the embedded broker exist, the demo decodes a bundled sample
of real frames sent by the official Pulsar client and prints them as a table.
"""

from __future__ import annotations

import argparse

NAME = "demo"
HELP = "run the main job on embedded defaults"
DESCRIPTION = """\
Decode and print a bundled sample of frames the official Pulsar client sent.

example:
  pulsar-tap demo
"""


def configure(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    del args
    from proxy.protocol.sample import print_sample

    print_sample()
    return 0

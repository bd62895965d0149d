"""The ``pulsar-tap`` console script: one argparse sub-command per module of this package.

Each sub-command module defines ``NAME``, ``HELP``, ``DESCRIPTION`` (help text with
examples), ``configure(parser)`` and ``run(args) -> int``; it imports heavy
dependencies inside ``run`` so that ``pulsar-tap --help`` stays fast.  Errors the
project raises on purpose become one line on stderr and a non-zero exit status,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from proxy import __version__
from proxy.errors import ConfigError, PulsarTapError, UsageError

#: sub-command modules, in the order ``--help`` lists them
SUBCOMMAND_MODULES = (
    "proxy.cli.rules",
    "proxy.cli.demo",
    "proxy.cli.run",
    "proxy.cli.broker",
    "proxy.cli.show",
    "proxy.cli.export",
    "proxy.cli.replay",
    "proxy.cli.perf",
    "proxy.cli.analyze",
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    parser = _Parser(
        prog="pulsar-tap",
        description="A protocol-aware TCP proxy and traffic recorder for Apache Pulsar.",
        epilog="Run 'pulsar-tap COMMAND --help' for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"pulsar-tap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    modules: dict[str, ModuleType] = {}
    for name in SUBCOMMAND_MODULES:
        module = importlib.import_module(name)
        sub_parser = sub.add_parser(
            module.NAME, help=module.HELP, description=module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.configure(sub_parser)
        modules[module.NAME] = module
    return parser, modules


def main(argv: Sequence[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        status: int = modules[args.command].run(args)
    except KeyboardInterrupt:
        return 0
    except UsageError as exc:
        print(f"pulsar-tap {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(exc.format(), file=sys.stderr)
        return 2
    except PulsarTapError as exc:
        print(f"pulsar-tap {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())

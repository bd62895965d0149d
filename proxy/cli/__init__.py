"""The ``pulsar-tap`` console script: one argparse sub-command per module of this package.

Each sub-command module defines ``NAME``, ``HELP``, ``DESCRIPTION`` (help text with
examples), ``configure(parser)`` and ``run(args) -> int``, and may define ``EPILOG``
(its exit statuses); it imports heavy dependencies inside ``run`` so that
``pulsar-tap --help`` stays fast.

Exit statuses (SPEC.md, "Interrupts"): 0 done, or stopped by the user with a
complete result; 1 a finding (``rules check``: errors in a file, ``replay``:
differences); 2 bad input or an error; 130 interrupted with an incomplete result.
Errors the project raises on purpose (also inside a Trio exception group) become
one line on stderr, never a traceback; so does anything unexpected, unless
``PULSAR_TAP_TRACEBACK=1`` asks for the traceback.  SIGINT and SIGTERM are handled
by :mod:`proxy.cli.interrupt`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from proxy import __version__
from proxy.cli.interrupt import EXIT_INTERRUPTED, handling_signals
from proxy.errors import ConfigError, PulsarTapError, UsageError, find_error
from proxy.native_threads import use_one_thread

#: exit status for bad input and errors
EXIT_ERROR = 2

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


_EPILOG = """\
Run 'pulsar-tap COMMAND --help' for a command's options and examples.

exit status (every command; each --help says which apply):
  0    done, or stopped by SIGINT/SIGTERM with a complete result
  1    a finding: rules check found errors, replay found differences
  2    bad input or an error (one line on stderr, never a traceback)
  130  interrupted by SIGINT/SIGTERM with an incomplete result
"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (they hold examples); every option's default shown."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None or "%(default)" in text or "default" in text.lower():
            return text
        if action.default in (None, False, argparse.SUPPRESS, [], "") or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    parser = _Parser(
        prog="pulsar-tap",
        description="A protocol-aware TCP proxy and traffic recorder for Apache Pulsar.",
        epilog=_EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pulsar-tap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    modules: dict[str, ModuleType] = {}
    for name in SUBCOMMAND_MODULES:
        module = importlib.import_module(name)
        sub_parser = sub.add_parser(
            module.NAME, help=module.HELP, description=module.DESCRIPTION,
            epilog=getattr(module, "EPILOG", None), formatter_class=HelpFormatter,
        )
        module.configure(sub_parser)
        modules[module.NAME] = module
    return parser, modules


def main(argv: Sequence[str] | None = None) -> int:
    """The console script (``argv`` None: the program's own arguments) or an in-process call (tests)."""
    with handling_signals(restore=argv is not None):
        try:
            return _main(argv)
        except KeyboardInterrupt:
            # a command that handles interrupts itself returns its own status; here the work was cut short
            print("pulsar-tap: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            _quiet_stdout()
            return 0


def _main(argv: Sequence[str] | None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    module = modules[args.command]
    if getattr(module, "ONE_THREAD", False):
        use_one_thread()  # (before numpy's import: the command's run imports it)
    try:
        status: int = module.run(args)
    except (PulsarTapError, BaseExceptionGroup) as exc:
        error = find_error(exc, PulsarTapError)
        if error is None:
            raise
        _report(args.command, error)
        return EXIT_ERROR
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as exc:
        if os.environ.get("PULSAR_TAP_TRACEBACK"):
            raise
        print(f"pulsar-tap {args.command}: internal error: {type(exc).__name__}: {exc} "
              "(PULSAR_TAP_TRACEBACK=1 shows where)", file=sys.stderr)
        return EXIT_ERROR
    return status


def _report(command: str, error: PulsarTapError) -> None:
    if isinstance(error, ConfigError) and not isinstance(error, UsageError):
        print(error.format(), file=sys.stderr)
    else:
        print(f"pulsar-tap {command}: error: {error}", file=sys.stderr)


def _quiet_stdout() -> None:
    """The reader of stdout went away (``| head``): stop quietly, as Unix tools do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())

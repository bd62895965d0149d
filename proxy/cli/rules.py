"""``pulsar-tap rules check FILE...``: validate rule files the way ``run`` would load them.

``rules list|add|rm|reset`` (a running proxy's rules) are in :mod:`proxy.cli.rules_admin`.
"""

from __future__ import annotations

import argparse
import sys

from proxy.cli import rules_admin

NAME = "rules"
HELP = "validate rule files; list, add and remove a running proxy's rules"
DESCRIPTION = """\
Check rule files (SPEC.md, "Rule language") without running the proxy.  Every
error of every file is printed on stderr as FILE:LINE: KEY: message (KEY is the
dotted path, e.g. rules[2].action.delay.ms); a valid file prints "FILE: N rules
OK" on stdout.  An unreadable file prints "FILE: cannot read: REASON".

examples:
  pulsar-tap rules check rules/slow-broker.yaml
  pulsar-tap rules check rules/*.yaml
"""
EPILOG = """\
exit status:
  0    check: every file is valid; list, add, rm, reset: done
  1    check: a file has errors (each printed as FILE:LINE: KEY: message)
  2    check: a file cannot be read; list, add, rm, reset: the admin API refused or cannot be reached;
       bad arguments
"""
CHECK_EPILOG = """\
exit status:
  0    every file is valid
  1    a file has errors (each printed as FILE:LINE: KEY: message)
  2    a file cannot be read (or bad arguments)
"""
DESCRIPTION += rules_admin.DESCRIPTION


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="rules_action", metavar="ACTION", required=True,
                                    parser_class=type(parser))
    from proxy.cli import HelpFormatter

    check = actions.add_parser("check", help="validate rule files", epilog=CHECK_EPILOG, formatter_class=HelpFormatter,
                               description="Validate rule files; every error names its file, line and key.\n\n"
                                           "examples:\n  pulsar-tap rules check rules/slow-broker.yaml\n"
                                           "  pulsar-tap rules check rules/*.yaml")
    check.add_argument("files", metavar="FILE", nargs="+", help="rule files (YAML)")
    rules_admin.configure_actions(actions)


def run(args: argparse.Namespace) -> int:
    if args.rules_action in rules_admin.ACTIONS:
        return rules_admin.run(args)
    return check_files(args.files)


def check_files(files: list[str]) -> int:
    """``rules check``: every error of every file; the exit status of the worst one."""
    from proxy.config.yaml_lines import CannotRead
    from proxy.rules.loader import RuleFileError, load_rules_file

    status = 0
    for file in files:
        try:
            ruleset = load_rules_file(file)
        except CannotRead as exc:
            print(exc.format(), file=sys.stderr)
            status = 2
            continue
        except RuleFileError as exc:
            for error in exc.errors:
                print(error.format(), file=sys.stderr)
            status = max(status, 1)
            continue
        print(f"{file}: {len(ruleset.rules)} rules OK")
    return status

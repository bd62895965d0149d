"""``pulsar-tap rules check FILE``: validate a rule file the way ``run`` would load it.

``rules list|add|rm|reset`` (a running proxy's rules) are in :mod:`proxy.cli.rules_admin`.
"""

from __future__ import annotations

import argparse
import sys

from proxy.cli import rules_admin

NAME = "rules"
HELP = "validate rule files; list, add and remove a running proxy's rules"
DESCRIPTION = """\
Check a rule file (SPEC.md, "Rule language") without running the proxy.  Every
error is printed on stderr as FILE:LINE: KEY: message (KEY is the dotted path,
e.g. rules[2].action.delay.ms) and the exit status is 1; a valid file prints
"FILE: N rules OK" and exits 0.  An unreadable file prints "FILE: cannot read:
REASON" and exits 2.

examples:
  pulsar-tap rules check rules/slow-broker.yaml
  for f in rules/*.yaml; do pulsar-tap rules check "$f" || exit 1; done
"""
DESCRIPTION += rules_admin.DESCRIPTION


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="rules_action", metavar="ACTION", required=True,
                                    parser_class=type(parser))
    check = actions.add_parser("check", help="validate a rule file",
                               description="Validate a rule file; errors name the file, line and key.")
    check.add_argument("file", metavar="FILE", help="the rule file (YAML)")
    rules_admin.configure_actions(actions)


def run(args: argparse.Namespace) -> int:
    if args.rules_action in rules_admin.ACTIONS:
        return rules_admin.run(args)
    from proxy.config.yaml_lines import CannotRead
    from proxy.rules.loader import RuleFileError, load_rules_file

    try:
        ruleset = load_rules_file(args.file)
    except CannotRead as exc:
        print(exc.format(), file=sys.stderr)
        return 2
    except RuleFileError as exc:
        for error in exc.errors:
            print(error.format(), file=sys.stderr)
        return 1
    count = len(ruleset.rules)
    print(f"{args.file}: {count} rules OK")
    return 0

"""``pulsar-tap rules list|add|rm|reset``: a running proxy's rules over its admin API, as toxiproxy-cli.

The ``rules`` command's other actions (``check``) live in :mod:`proxy.cli.rules`;
this module adds the ones that talk to a proxy.  Every call goes through
:class:`~proxy.testing.admin_client.AdminClient`; every refusal is one line on
stderr and exit status 2: the admin API cannot be reached, 401 (give
``--token-file``), 404 (no such rule), 409 (the name is taken), 400 (the
validation message, ``KEY: message``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.testing.admin_client import AdminClient

ADMIN_ENV = "PULSAR_TAP_ADMIN"
TOKEN_FILE_ENV = "PULSAR_TAP_TOKEN_FILE"

DESCRIPTION = f"""
A running proxy's rules (its admin API, `--admin HOST:PORT` of `pulsar-tap run`):
  list    the rules in force, with their hits (--json: GET /rules as it is)
  add     one rule from ACTION [PARAM=VALUE ...] and match flags, or every rule of --file
  rm      remove rules by name
  reset   remove every rule (the seed is kept), or put --file's rules in force instead
--admin defaults to ${ADMIN_ENV}, --token-file to ${TOKEN_FILE_ENV}.
Errors are one line on stderr with exit status 2 (unreachable admin API, 401, 404,
409, 400 with the validation message).

examples:
  pulsar-tap rules list --admin 127.0.0.1:9650
  pulsar-tap rules add --admin 127.0.0.1:9650 delay ms=200 jitter_ms=50 --command SEND_RECEIPT --topic 'orders-*'
  pulsar-tap rules add --admin 127.0.0.1:9650 --name flaky error code=ServiceNotReady --command PRODUCER --times 2
  pulsar-tap rules add --admin 127.0.0.1:9650 --file rules/slow-broker.yaml
  pulsar-tap rules rm --admin 127.0.0.1:9650 flaky
  pulsar-tap rules reset --admin 127.0.0.1:9650 --token-file /etc/pulsar-tap/token
"""

_MATCH_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--subscription", "subscription", "only consumers on subscriptions matching this glob"),
    ("--producer-name", "producer_name", "only producers whose name matches this glob"),
    ("--consumer-name", "consumer_name", "only consumers whose name matches this glob"),
    ("--client", "client", "only clients in this network (CIDR)"),
)


def _admin_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin", metavar="URL", default=os.environ.get(ADMIN_ENV),
                        help=f"the proxy's admin API, HOST:PORT or http://HOST:PORT (default ${ADMIN_ENV})")
    parser.add_argument("--token-file", metavar="FILE", default=os.environ.get(TOKEN_FILE_ENV),
                        help=f"file holding the admin API's bearer token (default ${TOKEN_FILE_ENV})")


def configure_actions(actions: Any) -> None:
    """Add list, add, rm and reset to the ``rules`` command's sub-parsers."""
    listing = actions.add_parser("list", help="list a running proxy's rules and their hits",
                                 description="List the rules in force on a running proxy, with their hits.",
                                 epilog="example: pulsar-tap rules list --admin 127.0.0.1:9650")
    _admin_options(listing)
    listing.add_argument("--json", action="store_true", help="print GET /rules as it is")

    add = actions.add_parser(
        "add", help="add a rule to a running proxy", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Add one rule (ACTION, its PARAM=VALUE parameters and the match flags), or every rule of\n"
                    "a rule file (--file), after the rules in force.  Values are read as YAML scalars\n"
                    "(ms=200 is a number, how=reset a string).",
        epilog="examples:\n"
               "  pulsar-tap rules add --admin 127.0.0.1:9650 delay ms=200 --command SEND_RECEIPT --topic orders\n"
               "  pulsar-tap rules add --admin 127.0.0.1:9650 disconnect how=reset --after 10 --times 1\n"
               "  pulsar-tap rules add --admin 127.0.0.1:9650 throttle messages_per_second=100 --topic 'orders-*'\n"
               "  pulsar-tap rules add --admin 127.0.0.1:9650 --file rules/flaky-producer-creation.yaml")
    _admin_options(add)
    add.add_argument("action", metavar="ACTION", nargs="?",
                     help="delay, drop, error, disconnect, close, corrupt, duplicate, rewrite, throttle, redirect, "
                          "record, mark or slice")
    add.add_argument("params", metavar="PARAM=VALUE", nargs="*", help="the action's parameters, e.g. ms=200")
    add.add_argument("--file", metavar="FILE", help="add every rule of this rule file instead")
    add.add_argument("--name", help="the rule's name (default: ACTION-<random>)")
    # (dest: ``args.command`` is the console script's sub-command)
    add.add_argument("--command", dest="match_commands", action="append", metavar="TYPE",
                     help="command type to match (repeatable)")
    add.add_argument("--direction", choices=("to_client", "to_broker", "any"), help="default any")
    add.add_argument("--topic", metavar="TOPIC", help="topic name or glob; short names as clients write them")
    add.add_argument("--topic-regex", metavar="REGEX", help="full topic names matching this regular expression")
    for flag, _, text in _MATCH_FLAGS:
        add.add_argument(flag, metavar="PATTERN", help=text)
    add.add_argument("--probability", type=float, metavar="P", help="act on each match with probability P")
    add.add_argument("--after", type=int, metavar="N", help="let the first N matches pass")
    add.add_argument("--times", type=int, metavar="N", help="act on N matches, then stop")

    remove = actions.add_parser("rm", help="remove rules from a running proxy",
                                description="Remove rules from a running proxy by name.",
                                epilog="example: pulsar-tap rules rm --admin 127.0.0.1:9650 slow-receipts flaky")
    _admin_options(remove)
    remove.add_argument("names", metavar="NAME", nargs="+", help="rule names (see rules list)")

    reset = actions.add_parser("reset", help="remove every rule of a running proxy (or replace them by a file's)",
                               description="Remove every rule of a running proxy (its seed is kept), or put the "
                                           "rules of --file in force instead, at once.",
                               epilog="example: pulsar-tap rules reset --admin 127.0.0.1:9650")
    _admin_options(reset)
    reset.add_argument("--file", metavar="FILE", help="put this rule file's rules (and seed) in force instead")


def run(args: argparse.Namespace) -> int:
    from proxy.config.yaml_lines import CannotRead
    from proxy.errors import UsageError
    from proxy.rules.loader import RuleFileError
    from proxy.testing.admin_client import AdminClient, read_token_file
    from proxy.testing.errors import AdminError, AdminUnauthorized

    command = f"pulsar-tap rules {args.rules_action}"
    if not args.admin:
        raise UsageError(f"give --admin HOST:PORT (or set ${ADMIN_ENV})")
    try:
        token = read_token_file(args.token_file) if args.token_file else None
        admin = AdminClient(args.admin, token)
    except ValueError as exc:
        raise UsageError(f"--admin: {exc}") from None
    except AdminError as exc:
        print(f"{command}: error: --token-file {exc}", file=sys.stderr)
        return 2
    try:
        return _ACTIONS[args.rules_action](admin, args)
    except CannotRead as exc:
        print(exc.format(), file=sys.stderr)
        return 2
    except RuleFileError as exc:
        for error in exc.errors:
            print(error.format(), file=sys.stderr)
        return 2
    except AdminError as exc:
        hint = "" if token or not isinstance(exc, AdminUnauthorized) else " (give --token-file)"
        status = f"{exc.status} " if exc.status else ""
        print(f"{command}: error: {status}{exc.message}{hint}", file=sys.stderr)
        return 2


def _list(admin: AdminClient, args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"seed": admin.seed(), "rules": [
            {**rule.to_rule(), "hits": rule.hits} for rule in admin.rules()]}, indent=2))
        return 0
    rules = admin.rules()
    print(f"seed {admin.seed()}, {len(rules)} rule{'s' if len(rules) != 1 else ''}")
    if not rules:
        return 0
    rows = [("NAME", "ACTION", "MATCH", "HITS")]
    rows += [(rule.name, _describe_action(rule.action), _describe_match(rule.match), str(rule.hits))
             for rule in rules]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return 0


def _describe_action(action: dict[str, Any]) -> str:
    name, params = next(iter(action.items()))
    if not params:
        return str(name)
    return f"{name} " + " ".join(f"{key}={_compact(value)}" for key, value in params.items())


def _describe_match(match: dict[str, Any]) -> str:
    defaults = {"direction": "any", "probability": 1.0, "after": 0}
    parts = [f"{key}={_compact(value)}" for key, value in match.items() if defaults.get(key, object()) != value]
    return " ".join(parts) or "any frame"


def _compact(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _add(admin: AdminClient, args: argparse.Namespace) -> int:
    from proxy.errors import UsageError

    if args.file:
        if args.action or args.params or args.name:
            raise UsageError("give either --file or ACTION [PARAM=VALUE ...], not both")
        for rule in _file_rules(args.file)["rules"]:
            added = admin.add_rule(rule)
            print(f"added rule {added.name}")
        return 0
    if not args.action:
        raise UsageError("give ACTION [PARAM=VALUE ...] (e.g. delay ms=200) or --file FILE")
    added = admin.add_rule(_rule_from_flags(args))
    print(f"added rule {added.name}: {_describe_action(added.action)}; {_describe_match(added.match)}")
    return 0


def _rule_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    import uuid

    import yaml

    from proxy.errors import UsageError
    from proxy.testing.faults import full_topic_pattern

    params: dict[str, Any] = {}
    for item in args.params:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UsageError(f"parameter {item!r} is not PARAM=VALUE")
        try:
            params[key] = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            params[key] = text
    match: dict[str, Any] = {}
    if args.match_commands:
        match["command"] = [c.upper() for c in args.match_commands]
    if args.direction:
        match["direction"] = args.direction
    if args.topic and args.topic_regex:
        raise UsageError("give --topic or --topic-regex, not both")
    if args.topic:
        match["topic"] = full_topic_pattern(args.topic)
    if args.topic_regex:
        match["topic"] = {"regex": args.topic_regex}
    for _, key, _ in _MATCH_FLAGS:
        value = getattr(args, key)
        if value is not None:
            match[key] = value
    for key in ("probability", "after", "times"):
        value = getattr(args, key)
        if value is not None:
            match[key] = value
    name = args.name or f"{args.action}-{uuid.uuid4().hex[:8]}"
    return {"name": name, "match": match, "action": {args.action: params}}


def _file_rules(path: str) -> dict[str, Any]:
    """A rule file, validated here (errors as ``rules check`` prints them), as the admin API takes it."""
    from proxy.rules.loader import load_rules_file

    ruleset = load_rules_file(path)
    document: dict[str, Any] = {"rules": [rule.to_data() for rule in ruleset.rules]}
    if ruleset.seed is not None:
        document["seed"] = ruleset.seed
    return document


def _remove(admin: AdminClient, args: argparse.Namespace) -> int:
    from proxy.testing.errors import RuleNotFound

    missing: list[str] = []
    for name in args.names:
        try:
            admin.remove_rule(name)
        except RuleNotFound:
            missing.append(name)
            continue
        print(f"removed rule {name}")
    if missing:
        print(f"pulsar-tap rules rm: error: 404 no rule named {', '.join(repr(n) for n in missing)}",
              file=sys.stderr)
        return 2
    return 0


def _reset(admin: AdminClient, args: argparse.Namespace) -> int:
    if args.file:
        document = _file_rules(args.file)
        rules = admin.replace_rules(document["rules"], seed=document.get("seed"))
        print(f"{len(rules)} rule{'s' if len(rules) != 1 else ''} of {args.file} in force")
        return 0
    before = len(admin.rules())
    admin.reset()
    print(f"removed {before} rule{'s' if before != 1 else ''}")
    return 0


_ACTIONS: dict[str, Callable[[AdminClient, argparse.Namespace], int]] = {
    "list": _list, "add": _add, "rm": _remove, "reset": _reset}
ACTIONS = tuple(_ACTIONS)

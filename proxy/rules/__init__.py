"""The rules engine: fault injection, rate limiting and selective recording from YAML.

``model`` (typed immutable rules), ``loader`` (YAML/JSON to rules, with
FILE:LINE: KEY errors; ``params`` reads one mapping), ``matcher`` (criteria),
``actions`` (one class per action: parameters, what it applies to, its verdict, the
frames it sends), ``throttle`` (token buckets), ``verdict`` (the Verdict, the one
decision type from engine to relay), ``engine`` (the
sans-IO evaluator with hot replace), ``hook`` (the engine as the proxy's hook),
``reload`` (watching a rule file), ``sampling`` (the draws of probability rules made
before decoding).
"""

from pathlib import Path as _Path

from proxy import compiled as _compiled

#: Modules scripts/setup.sh compiles with mypyc (proxy.compiled): a sampled rule's draws run in the relay's rows.
COMPILED_MODULES = ("sampling",)
_compiled.guard(__name__, _Path(__file__).parent, COMPILED_MODULES)

# (imported after the guard: the engine imports sampling)
from proxy.rules.engine import RulesEngine  # noqa: E402
from proxy.rules.loader import (  # noqa: E402
    RuleFileError,
    load_rules_file,
    load_rules_text,
    rule_from_data,
    ruleset_from_data,
)
from proxy.rules.model import Rule, RuleSet  # noqa: E402
from proxy.rules.verdict import Deferred, Verdict  # noqa: E402

__all__ = ["Deferred", "Rule", "RuleFileError", "RuleSet", "RulesEngine", "Verdict", "load_rules_file",
           "load_rules_text", "rule_from_data", "ruleset_from_data"]

"""The rules engine: fault injection, rate limiting and selective recording from YAML.

``model`` (typed immutable rules), ``loader`` (YAML/JSON to rules, with
FILE:LINE: KEY errors; ``params`` reads one mapping), ``matcher`` (criteria),
``actions`` (one class per action: parameters, what it applies to, its verdict, the
frames it sends), ``throttle`` (token buckets), ``verdict`` (the Verdict, the one
decision type from engine to relay), ``engine`` (the
sans-IO evaluator with hot replace), ``hook`` (the engine as the proxy's hook),
``reload`` (watching a rule file).
"""

from proxy.rules.engine import RulesEngine
from proxy.rules.loader import RuleFileError, load_rules_file, load_rules_text, rule_from_data, ruleset_from_data
from proxy.rules.model import Rule, RuleSet
from proxy.rules.verdict import Deferred, Verdict

__all__ = ["Deferred", "Rule", "RuleFileError", "RuleSet", "RulesEngine", "Verdict", "load_rules_file",
           "load_rules_text", "rule_from_data", "ruleset_from_data"]

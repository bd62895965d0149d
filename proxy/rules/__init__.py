"""The rules engine: fault injection, rate limiting and selective recording from YAML.

``model`` (typed immutable rules), ``loader`` (YAML/JSON to rules, with
FILE:LINE: KEY errors), ``matcher`` (criteria), ``actions`` (the frames actions
send), ``throttle`` (token buckets), ``verdict`` (the Decision), ``engine`` (the
sans-IO evaluator with hot replace), ``hook`` (the engine as the proxy's hook),
``reload`` (watching a rule file).
"""

from proxy.rules.engine import RulesEngine
from proxy.rules.loader import RuleFileError, load_rules_file, load_rules_text, rule_from_data, ruleset_from_data
from proxy.rules.model import Rule, RuleSet
from proxy.rules.verdict import Decision, Deferred

__all__ = ["Decision", "Deferred", "Rule", "RuleFileError", "RuleSet", "RulesEngine", "load_rules_file",
           "load_rules_text", "rule_from_data", "ruleset_from_data"]

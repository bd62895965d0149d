import sys
from pathlib import Path

# the helpers module sits beside the tests
sys.path.insert(0, str(Path(__file__).parent))

from rules_proxy import rules_proxy

from proxy.broker.testing import broker, broker_cluster

__all__ = ["broker", "broker_cluster", "rules_proxy"]

"""The embedded Pulsar broker: an in-memory cluster the official clients accept.

Modules, one concept each: :mod:`naming` (topic names, hashes), :mod:`ledger`
(stored entries), :mod:`cursor` (acks and read position), :mod:`selectors`
(Failover and Key_Shared consumer choice), :mod:`subscription` (dispatch,
permits, redelivery), :mod:`topic` (producers, publishing, schemas),
:mod:`cluster` (brokers, ownership, lookups' answers), :mod:`connection` (the
broker side of one connection, sans-IO), :mod:`server` (Trio listeners),
:mod:`embedded` (running a cluster in Trio or in a thread), :mod:`admin`
(the admin REST API) and :mod:`testing` (pytest fixtures other suites reuse);
geo-replication: :mod:`replication` (replicator cursors, what each entry becomes),
:mod:`replicated_subscriptions` (snapshots and subscription updates) and
:mod:`replicator` (the replicators and snapshot timer on Trio).
"""

from proxy.broker.cluster import Cluster, ClusterConfig
from proxy.broker.embedded import ClusterRunner, ThreadedCluster, open_cluster

__all__ = ["Cluster", "ClusterConfig", "ClusterRunner", "ThreadedCluster", "open_cluster"]

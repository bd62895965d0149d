"""The embedded broker's admin REST API: a subset of Pulsar's admin API v2, as ASGI.

Paths and bodies follow Pulsar's ``PersistentTopics`` and ``TopicLookup`` resources,
so tools that drive a real broker over HTTP drive this one the same way:

=======  ==========================================================  ==========================
method   path                                                        answer
=======  ==========================================================  ==========================
PUT      /admin/v2/persistent/{tenant}/{ns}/{topic}/partitions        204; body = partition count
GET      /admin/v2/persistent/{tenant}/{ns}/{topic}/partitions        {"partitions": N}
GET      /admin/v2/persistent/{tenant}/{ns}/partitioned               ["persistent://...", ...]
GET      /admin/v2/persistent/{tenant}/{ns}                           every topic (partitions too)
PUT      /admin/v2/persistent/{tenant}/{ns}/{topic}/unload            204
POST     /admin/v2/persistent/{tenant}/{ns}/{topic}/terminate         {"ledgerId", "entryId", ...}
GET      /admin/v2/persistent/{tenant}/{ns}/{topic}/stats             TopicStats (msgRateIn, ...)
GET      /admin/v2/persistent/{tenant}/{ns}/{topic}/partitioned-stats the same, over all partitions
GET      /lookup/v2/topic/persistent/{tenant}/{ns}/{topic}            {"brokerUrl", "httpUrl", ...}
PUT      /admin/v2/namespaces/{tenant}/{ns}                          204; 409 when it exists (only with
                                                                     ClusterConfig.known_namespaces set)
=======  ==========================================================  ==========================

Errors answer ``{"reason": ...}`` with Pulsar's status codes (404 unknown topic,
409 already exists, 412 bad input).  Served by hypercorn on the broker's Trio loop,
so handlers call the cluster directly.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any, Final

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from proxy.asgi import Receive, Scope, Send, answered_outside_http
from proxy.broker.cluster import Cluster
from proxy.broker.naming import TopicName
from proxy.broker.topic import Topic
from proxy.errors import BrokerError

_PERSISTENT: Final = r"/admin/v2/persistent/(?P<tenant>[^/]+)/(?P<ns>[^/]+)"
_ROUTES: Final[list[tuple[str, re.Pattern[str], str]]] = [
    ("PUT", re.compile(_PERSISTENT + r"/(?P<topic>[^/]+)/partitions$"), "create_partitioned"),
    ("GET", re.compile(_PERSISTENT + r"/(?P<topic>[^/]+)/partitions$"), "partitioned_metadata"),
    ("GET", re.compile(_PERSISTENT + r"/partitioned$"), "list_partitioned"),
    ("GET", re.compile(_PERSISTENT + r"/?$"), "list_topics"),
    ("PUT", re.compile(_PERSISTENT + r"/(?P<topic>[^/]+)/unload$"), "unload"),
    ("POST", re.compile(_PERSISTENT + r"/(?P<topic>[^/]+)/terminate$"), "terminate"),
    ("GET", re.compile(_PERSISTENT + r"/(?P<topic>[^/]+)/stats$"), "stats"),
    ("GET", re.compile(_PERSISTENT + r"/(?P<topic>[^/]+)/partitioned-stats$"), "stats"),
    ("PUT", re.compile(r"/admin/v2/namespaces/(?P<tenant>[^/]+)/(?P<ns>[^/]+)/?$"), "create_namespace"),
    ("GET", re.compile(r"/lookup/v2/topic/persistent/(?P<tenant>[^/]+)/(?P<ns>[^/]+)/(?P<topic>[^/]+)$"),
     "lookup"),
]
_STATUS_OF_ERROR: Final = {"TopicNotFound": 404, "InvalidTopicName": 412, "NotAllowedError": 409,
                           "ServiceNotReady": 503}


class HttpError(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class AdminApp:
    """The ASGI application over one cluster."""

    def __init__(self, cluster: Cluster, http_url: str = "") -> None:
        self.cluster = cluster
        self.http_url = http_url

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_outside_http(scope, receive, send):
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, payload = self.handle(scope["method"], scope["path"], body)
        data = b"" if payload is None else json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json")] if payload is not None else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        """Route one request; returns (status, JSON-able body or None)."""
        allowed = False
        for route_method, pattern, name in _ROUTES:
            match = pattern.match(path)
            if match is None:
                continue
            allowed = True
            if route_method != method:
                continue
            try:
                result: tuple[int, Any] = getattr(self, name)(body=body, **match.groupdict())
            except HttpError as exc:
                return exc.status, {"reason": exc.reason}
            except BrokerError as exc:
                return _STATUS_OF_ERROR.get(exc.server_error, 500), {"reason": exc.message}
            return result
        if allowed:
            return 405, {"reason": "Method Not Allowed"}
        return 404, {"reason": "Not Found"}

    # -- resources ----------------------------------------------------------------------

    @staticmethod
    def _name(tenant: str, ns: str, topic: str) -> str:
        return str(TopicName("persistent", tenant, ns, topic))

    def create_partitioned(self, *, tenant: str, ns: str, topic: str, body: bytes) -> tuple[int, Any]:
        try:
            partitions = int(json.loads(body or b"null"))
        except (ValueError, TypeError):
            raise HttpError(412, "The number of partitions must be an integer") from None
        if partitions <= 0:
            raise HttpError(412, "The number of partitions should be more than 0")
        name = self._name(tenant, ns, topic)
        if name in self.cluster.partitioned or name in self.cluster.topics:
            raise HttpError(409, "This topic already exists")
        self.cluster.create_topic(name, partitions)
        return 204, None

    def create_namespace(self, *, tenant: str, ns: str, body: bytes) -> tuple[int, Any]:
        namespace = f"{tenant}/{ns}"
        if not self.cluster.create_namespace(namespace) and self.cluster.namespaces is not None:
            raise HttpError(409, "Namespace already exists")
        return 204, None

    def partitioned_metadata(self, *, tenant: str, ns: str, topic: str, body: bytes) -> tuple[int, Any]:
        return 200, {"partitions": self.cluster.partitions_of(self._name(tenant, ns, topic), auto_create=False)}

    def list_partitioned(self, *, tenant: str, ns: str, body: bytes) -> tuple[int, Any]:
        return 200, self.cluster.partitioned_topics_of_namespace(f"{tenant}/{ns}")

    def list_topics(self, *, tenant: str, ns: str, body: bytes) -> tuple[int, Any]:
        return 200, self.cluster.topics_of_namespace(f"{tenant}/{ns}")

    def unload(self, *, tenant: str, ns: str, topic: str, body: bytes) -> tuple[int, Any]:
        self.cluster.unload(self._name(tenant, ns, topic))
        return 204, None

    def terminate(self, *, tenant: str, ns: str, topic: str, body: bytes) -> tuple[int, Any]:
        name = self._name(tenant, ns, topic)
        if name in self.cluster.partitioned:
            raise HttpError(405, "Termination of a partitioned topic is not allowed")
        ledger_id, entry_id = self.cluster.terminate(name)
        topic_obj = self.cluster.topics[name]
        return 200, {"ledgerId": ledger_id, "entryId": entry_id, "partitionIndex": topic_obj.partition_index}

    def stats(self, *, tenant: str, ns: str, topic: str, body: bytes) -> tuple[int, Any]:
        topics = self.cluster.resolve(self._name(tenant, ns, topic))
        return 200, _merge_stats([topic_stats(t) for t in topics])

    def lookup(self, *, tenant: str, ns: str, topic: str, body: bytes) -> tuple[int, Any]:
        owner = self.cluster.owner(self._name(tenant, ns, topic))
        return 200, {"brokerUrl": owner.service_url, "brokerUrlTls": "", "httpUrl": self.http_url,
                     "httpUrlTls": "", "nativeUrl": owner.service_url}


def topic_stats(topic: Topic) -> dict[str, Any]:
    """One topic's statistics, with Pulsar's TopicStats field names."""
    rate_in, throughput_in = topic.rates(time.monotonic_ns())
    subscriptions: dict[str, Any] = {}
    for name, sub in topic.subscriptions.items():
        subscriptions[name] = {
            "msgBacklog": sub.backlog(),
            "unackedMessages": sub.unacked(),
            "type": _sub_type_name(sub.sub_type),
            "isDurable": sub.durable,
            "msgOutCounter": sub.messages_out,
            "bytesOutCounter": sub.bytes_out,
            "msgRateOut": 0.0,
            "isReplicated": sub.replicated,
            "markDeletePosition": f"{topic.ledger.ledger_id}:{sub.cursor.mark_delete}",
            "consumers": [{
                "consumerName": c.consumer_name,
                "availablePermits": c.permits,
                "unackedMessages": c.unacked_messages,
                "msgOutCounter": c.messages_out,
                "bytesOutCounter": c.bytes_out,
                "priorityLevel": c.priority_level,
            } for c in sub.consumers],
        }
    return {
        "msgRateIn": rate_in,
        "msgThroughputIn": throughput_in,
        "msgInCounter": topic.stats.messages_in,
        "bytesInCounter": topic.stats.bytes_in,
        "storageSize": topic.ledger.total_bytes,
        "publishers": [{"producerName": p.producer_name, "producerId": p.producer_id,
                        "accessMode": _access_mode_name(p.access_mode),
                        "msgInCounter": p.messages_in, "bytesInCounter": p.bytes_in}
                       for p in topic.producers],
        "subscriptions": subscriptions,
        "deduplicationStatus": "Enabled" if topic.dedup_enabled else "Disabled",
        "topicEpoch": topic.epoch,
        "replication": replication_stats(topic),
    }


def replication_stats(topic: Topic) -> dict[str, Any]:
    """Per remote cluster, Pulsar's ReplicatorStats fields (plus evicted and marker counts)."""
    geo = topic.geo
    if geo is None:
        return {}
    now_ms = int(time.time() * 1000)
    stats: dict[str, Any] = {}
    for remote, replicator in geo.replicators.items():
        counters = replicator.stats
        stats[remote] = {
            "connected": replicator.connected(),
            "replicationBacklog": replicator.backlog(),
            "replicationDelayInSeconds": replicator.delay_ms(now_ms) // 1000,
            "msgOutCounter": counters.messages_out,
            "bytesOutCounter": counters.bytes_out,
            "markersOutCounter": counters.markers_out,
            "msgEvictedCounter": counters.messages_evicted,
            "producerName": replicator.producer_name,
        }
    return stats


def _merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if len(parts) == 1:
        return parts[0]
    merged: dict[str, Any] = {"msgRateIn": 0.0, "msgThroughputIn": 0.0, "msgInCounter": 0, "bytesInCounter": 0,
                              "storageSize": 0, "publishers": [], "subscriptions": {}}
    for part in parts:
        for key in ("msgRateIn", "msgThroughputIn", "msgInCounter", "bytesInCounter", "storageSize"):
            merged[key] += part[key]
        merged["publishers"].extend(part["publishers"])
        for name, sub in part["subscriptions"].items():
            into = merged["subscriptions"].setdefault(
                name, {**sub, "msgBacklog": 0, "unackedMessages": 0, "msgOutCounter": 0, "bytesOutCounter": 0,
                       "consumers": []})
            for key in ("msgBacklog", "unackedMessages", "msgOutCounter", "bytesOutCounter"):
                into[key] += sub[key]
            into["consumers"].extend(sub["consumers"])
        for remote, replicator in part.get("replication", {}).items():
            remotes = merged.setdefault("replication", {})
            if remote not in remotes:
                remotes[remote] = {**replicator}
                continue
            total = remotes[remote]
            total["connected"] = total["connected"] and replicator["connected"]
            total["replicationDelayInSeconds"] = max(total["replicationDelayInSeconds"],
                                                     replicator["replicationDelayInSeconds"])
            for key in ("replicationBacklog", "msgOutCounter", "bytesOutCounter", "markersOutCounter",
                        "msgEvictedCounter"):
                total[key] += replicator[key]
    return merged


def _sub_type_name(sub_type: int) -> str:
    from proxy.pb import PulsarApi_pb2 as api
    return str(api.CommandSubscribe.SubType.Name(sub_type))


def _access_mode_name(mode: int) -> str:
    from proxy.pb import PulsarApi_pb2 as api
    return str(api.ProducerAccessMode.Name(mode))


async def serve_admin(cluster: Cluster, host: str, port: int, *,
                      task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the admin API until cancelled; reports the bound HOST:PORT when listening."""
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("pulsar_tap.broker.admin")
    app = AdminApp(cluster)

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            lambda task_status: serve(app, config,  # type: ignore[arg-type]  # hypercorn's ASGI types are TypedDicts
                                      shutdown_trigger=trio.sleep_forever, task_status=task_status))
        address = binds[0].split("://", 1)[1]
        app.http_url = f"http://{address}"
        task_status.started(address)

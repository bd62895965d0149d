"""The admin API over a real loopback socket (hypercorn on Trio) with a real HTTP client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import trio
from rules_helpers import TO_BROKER, Session, engine_for, frame

from proxy.admin import AdminApp
from proxy.admin.serve import serve_admin
from proxy.pb import PulsarApi_pb2 as api

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RULES = """\
seed: 17
rules:
  - name: slow
    match: {command: [PING]}
    action: {delay: {ms: 300}}
  - name: tag
    action: mark
"""


@pytest.fixture
async def admin(nursery: trio.Nursery) -> AsyncIterator[tuple[httpx.AsyncClient, AdminApp, Session]]:
    engine = engine_for(RULES)
    app = AdminApp(engine, token=TOKEN,
                   connections=lambda: [{"conn": 1, "client": "127.0.0.1:5000", "producers": 1}],
                   metrics=lambda: "pulsar_tap_frames_total{command=\"PING\",direction=\"to_broker\"} 3")
    with trio.fail_after(10):
        (url,) = await nursery.start(serve_admin, app, "127.0.0.1", 0)
    assert url.startswith("http://127.0.0.1:")
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        yield client, app, Session(engine)
    nursery.cancel_scope.cancel()


async def test_healthz_needs_no_token_but_everything_else_does(admin) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = admin
    with trio.fail_after(10):
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        for method, path in [("GET", "/rules"), ("PUT", "/rules"), ("POST", "/rules"), ("DELETE", "/rules/slow"),
                             ("GET", "/connections"), ("GET", "/metrics")]:
            response = await client.request(method, path)
            assert response.status_code == 401, (method, path)
            assert response.headers["www-authenticate"].startswith("Bearer")
        wrong = await client.get("/rules", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401


async def test_get_rules_is_normalised_with_seed_and_hits(admin) -> None:  # type: ignore[no-untyped-def]
    client, _, session = admin
    session.decide(frame(api.CommandPing()), TO_BROKER)
    with trio.fail_after(10):
        body = (await client.get("/rules", headers=AUTH)).json()
    assert body == {"seed": 17, "rules": [
        {"name": "slow", "match": {"command": ["PING"], "direction": "any", "probability": 1.0, "after": 0},
         "action": {"delay": {"ms": 300.0, "jitter_ms": 0.0}}, "hits": 1},
        {"name": "tag", "match": {"direction": "any", "probability": 1.0, "after": 0}, "action": {"mark": {}},
         "hits": 1},
    ]}


async def test_post_put_delete_change_the_rules_in_force(admin) -> None:  # type: ignore[no-untyped-def]
    client, app, session = admin
    with trio.fail_after(10):
        created = await client.post("/rules", headers=AUTH, json={"name": "drop-pings", "action": "drop"})
        assert created.status_code == 201
        assert created.json()["action"] == {"drop": {}}
        again = await client.post("/rules", headers=AUTH, json={"name": "drop-pings", "action": "drop"})
        assert again.status_code == 409
        yaml_rule = "name: pace\nmatch: {command: [SEND]}\naction: {throttle: {messages_per_second: 5}}\n"
        assert (await client.post("/rules", headers={**AUTH, "Content-Type": "application/yaml"},
                                  content=yaml_rule)).status_code == 201
        assert app.engine.hits() == {"slow": 0, "tag": 0, "drop-pings": 0, "pace": 0}

        assert (await client.delete("/rules/slow", headers=AUTH)).status_code == 204
        assert (await client.delete("/rules/slow", headers=AUTH)).status_code == 404
        # with 'slow' gone the first action-bearing rule for PING is the new drop
        assert not session.decide(frame(api.CommandPing()), TO_BROKER).forward

        replaced = await client.put("/rules", headers=AUTH, content=json.dumps(
            {"seed": 5, "rules": [{"name": "tag", "action": "mark"}]}),)
        assert replaced.status_code == 200
        assert replaced.json()["seed"] == 5
        assert [r["name"] for r in replaced.json()["rules"]] == ["tag"]
        assert replaced.json()["rules"][0]["hits"] == 1  # unchanged rule kept its counter
        assert app.engine.rules[0].name == "tag"


async def test_bad_bodies_are_400_with_the_validation_message(admin) -> None:  # type: ignore[no-untyped-def]
    client, app, _ = admin
    with trio.fail_after(10):
        bad = await client.post("/rules", headers=AUTH, json={"name": "x", "action": {"delay": {"ms": -1}}})
        assert bad.status_code == 400
        assert bad.json()["errors"] == ["action.delay.ms: must be >= 0, not -1"]
        bad_doc = await client.put("/rules", headers={**AUTH, "Content-Type": "application/yaml"},
                                   content="rules:\n  - name: y\n    action: {error: {code: Nope}}\n")
        assert bad_doc.status_code == 400
        assert bad_doc.json()["errors"] == ["body:3: rules[0].action.error.code: unknown ServerError 'Nope'"]
        assert (await client.post("/rules", headers=AUTH, content=b"{not json",
                                  )).status_code == 400
        assert (await client.post("/rules", headers={**AUTH, "Content-Type": "application/json"},
                                  content=b"{not json")).status_code == 400
        assert (await client.post("/rules", headers=AUTH)).status_code == 400
    assert [rule.name for rule in app.engine.rules] == ["slow", "tag"]


async def test_connections_metrics_and_unknown_routes(admin) -> None:  # type: ignore[no-untyped-def]
    client, _, session = admin
    session.decide(frame(api.CommandPing()), TO_BROKER)
    with trio.fail_after(10):
        connections = await client.get("/connections", headers=AUTH)
        assert connections.json() == {"connections": [{"conn": 1, "client": "127.0.0.1:5000", "producers": 1}]}
        metrics = await client.get("/metrics", headers=AUTH)
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        lines = metrics.text.splitlines()
        assert 'pulsar_tap_rule_hits_total{rule="slow"} 1' in lines
        assert 'pulsar_tap_rule_hits_total{rule="tag"} 1' in lines
        assert 'pulsar_tap_frames_total{command="PING",direction="to_broker"} 3' in lines
        assert (await client.get("/nothing", headers=AUTH)).status_code == 404
        assert (await client.patch("/rules", headers=AUTH)).status_code == 405


# -- bounded documents (issue #12, item 5) ----------------------------------------------------------
def alias_bomb(levels: int, body: str = "name: bomb\nmatch: {{command: *a{levels}}}\naction: drop\n") -> str:
    """A 'billion laughs' document: each level is nine aliases of the one before (9**levels values)."""
    lines = ['x0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"x{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n" + body.format(levels=levels)


@pytest.mark.parametrize("levels", [8, 9])
async def test_an_alias_bomb_is_refused_at_once_and_the_rules_stay(admin, levels: int) -> None:  # type: ignore[no-untyped-def]
    """A 316-byte body froze the proxy 6.3 s at 1.9 GB (8 levels); 9 levels: over 60 s and 7.6 GB."""
    from structlog.testing import capture_logs

    client, _, _ = admin
    body = alias_bomb(levels)
    assert len(body) < 600
    with trio.fail_after(10), capture_logs() as logs:
        response = await client.post("/rules", content=body, headers={**AUTH, "content-type": "application/yaml"})
        assert response.status_code == 400
        assert "expands to more than 100,000 values with its aliases" in response.json()["error"]
        assert [entry["event"] for entry in logs] == ["admin request refused"]
        assert [r["name"] for r in (await client.get("/rules", headers=AUTH)).json()["rules"]] == ["slow", "tag"]


@pytest.mark.parametrize(("content_type", "body", "message"), [
    ("application/json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("application/json", "[" * 40 + "]" * 40, "nested more than 32 levels deep"),
    ("application/yaml", "[" * 100_000 + "]" * 100_000, "nested more than 32 levels deep"),
    ("application/yaml", "a:\n" + "".join("  " * i + "b:\n" for i in range(1, 60)), "nested more than 32 levels"),
], ids=["json-100k", "json-40", "yaml-100k", "yaml-blocks"])
async def test_deeply_nested_bodies_are_400_with_a_message(admin, content_type: str, body: str,  # type: ignore[no-untyped-def]
                                                           message: str) -> None:
    """They were a 500 with an empty body and nothing in the log."""
    client, _, _ = admin
    with trio.fail_after(10):
        response = await client.put("/rules", content=body, headers={**AUTH, "content-type": content_type})
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_rule_files_and_proxy_yaml_are_bounded_too(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import signal

    from proxy.cli import main
    from proxy.config.proxy_config import load_config
    from proxy.errors import ConfigError

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError("the loader expanded the aliases")

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 20)
    rules = tmp_path / "rules.yaml"
    rules.write_text(alias_bomb(9, "rules: *a{levels}\n"))
    try:
        assert main(["rules", "check", str(rules)]) == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    err = capsys.readouterr().err
    assert err == f"{rules}:1: yaml: expands to more than 100,000 values with its aliases\n"
    config = tmp_path / "proxy.yaml"
    config.write_text("upstream: pulsar://127.0.0.1:6650\n" + alias_bomb(9, "rules: *a{levels}\n"))
    with pytest.raises(ConfigError, match="expands to more than 100,000 values"):
        load_config(config)

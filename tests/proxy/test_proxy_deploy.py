"""deploy/: the Dockerfile, the Kubernetes sidecar manifest and the systemd unit parse,
and name only flags the CLI accepts and config keys proxy.yaml accepts."""

from __future__ import annotations

import configparser
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import build_parser
from proxy.cli.run import load
from proxy.config.proxy_config import parse_config
from proxy.config.yaml_lines import load_text

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def parse_cli(argv: list[str]) -> Any:
    """Parse a pulsar-tap command line as the console script would (SystemExit on a bad flag)."""
    parser, _ = build_parser()
    return parser.parse_args(argv)


def dockerfile_instructions() -> dict[str, list[str]]:
    instructions: dict[str, list[str]] = {}
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.setdefault(word.upper(), []).append(rest.strip())
    return instructions


def test_the_dockerfile_runs_pulsar_tap_run_with_accepted_flags_and_a_valid_config() -> None:
    instructions = dockerfile_instructions()
    assert instructions["FROM"][0].startswith("python:3.11")
    entrypoint = json.loads(instructions["ENTRYPOINT"][-1])
    command = json.loads(instructions["CMD"][-1])
    assert entrypoint == ["pulsar-tap"]
    args = parse_cli(command)
    assert args.command == "run"
    assert args.config == "/etc/pulsar-tap/proxy.yaml"
    # what it copies exists, and the config it installs is valid
    root = DEPLOY.parent
    for copy in instructions["COPY"]:
        *sources, _ = copy.split()
        for source in sources:
            assert (root / source).exists(), source
    assert "STOPSIGNAL" in instructions and instructions["STOPSIGNAL"] == ["SIGTERM"]
    config = load(parse_cli(["run", "-c", str(DEPLOY / "proxy.yaml")]))
    assert config.listen.host == "0.0.0.0"


def test_the_systemd_unit_starts_pulsar_tap_run_with_accepted_flags() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "pulsar-tap.service")
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[0].endswith("/pulsar-tap")
    args = parse_cli(argv[1:])
    assert args.command == "run" and args.config == "/etc/pulsar-tap/proxy.yaml"
    assert unit["Service"]["KillSignal"] == "SIGTERM"


def test_the_kubernetes_manifest_runs_a_sidecar_beside_a_broker_with_a_valid_config() -> None:
    documents = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes-sidecar.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in documents}
    assert {"ConfigMap", "StatefulSet", "Service"} <= set(kinds)
    containers = kinds["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    names = [c["name"] for c in containers]
    assert "broker" in names and "pulsar-tap" in names
    sidecar = next(c for c in containers if c["name"] == "pulsar-tap")
    args = parse_cli(sidecar["args"])
    assert args.command == "run"
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "config")
    assert args.config == f"{mount['mountPath']}/proxy.yaml"
    config_text = kinds["ConfigMap"]["data"]["proxy.yaml"]
    config = parse_config(load_text(config_text, "kubernetes-sidecar.yaml#proxy.yaml"), file="k8s")
    # the proxy listens where the Service and the probe look, and forwards to the broker beside it
    tap_port = next(p["containerPort"] for p in sidecar["ports"] if p["name"] == "tap")
    assert config.listen.port == tap_port == sidecar["readinessProbe"]["tcpSocket"]["port"]
    broker = next(c for c in containers if c["name"] == "broker")
    assert config.upstream.address.port in {p["containerPort"] for p in broker["ports"]}


@pytest.mark.parametrize("argv", [["run", "--no-such-flag"], ["run", "--lookup", "sideways"]])
def test_the_parser_used_here_does_reject_unknown_flags(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_cli(argv)

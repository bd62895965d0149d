"""proxy.yaml: every SPEC key accepted, every mistake one error naming file, line and key."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from proxy.cli import build_parser
from proxy.cli.run import load
from proxy.config.proxy_config import HostPort, load_config
from proxy.config.yaml_lines import CannotRead, LineList, LineMap, load_text
from proxy.errors import ConfigError, UsageError

FULL = """\
listen: 127.0.0.1:6650
upstream: pulsar://broker:6650
advertise: 127.0.0.1
lookup: rewrite
tls: {cert: cert.pem, key: key.pem, upstream_ca: ca.pem}
admin: {listen: 127.0.0.1:9650, token_file: token}
record: {dir: recordings/, redact: true, max_segment_mb: 256, include_payloads: true}
tracing: {exporter: otlp, endpoint: "http://collector:4318", protocol: http, sample: 0.5}
limits: {max_connections: 10000, max_frame_bytes: 5242880, verify_checksums: true}
rules: rules/chaos.yaml
broker_ports: 7000-7010
allowed_brokers: [broker-1:6650, "pulsar://broker-2:6650"]
"""


def write(tmp_path: Path, text: str, name: str = "proxy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def full_dir(tmp_path: Path) -> Path:
    for name in ("cert.pem", "key.pem", "ca.pem", "token"):
        (tmp_path / name).write_text("x")
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "chaos.yaml").write_text("rules: []\n")
    return tmp_path


def test_the_spec_example_with_every_key_loads(full_dir: Path) -> None:
    config = load_config(write(full_dir, FULL))
    assert config.listen == HostPort("127.0.0.1", 6650)
    assert str(config.upstream) == "pulsar://broker:6650"
    assert config.tls.cert == str(full_dir / "cert.pem") and config.tls.serves_tls
    assert config.admin is not None and config.admin.listen.port == 9650
    assert config.record is not None and config.record.dir == "recordings/"
    assert config.tracing.exporter == "otlp" and config.tracing.sample == 0.5
    assert config.limits.verify_checksums and config.limits.max_frame_bytes == 5242880
    assert config.rules == str(full_dir / "rules" / "chaos.yaml")
    assert config.broker_ports == (7000, 7010)
    assert [str(a) for a in config.allowed_brokers] == ["broker-1:6650", "broker-2:6650"]


def test_defaults_are_the_specs(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "upstream: pulsar+ssl://b\n"))
    assert str(config.listen) == "127.0.0.1:6650" and config.lookup == "rewrite"
    assert str(config.upstream) == "pulsar+ssl://b:6651"
    assert config.limits.max_frame_bytes == 5 * 1024 * 1024 + 10 * 1024
    assert config.limits.max_connections == 10000


@pytest.mark.parametrize(("text", "line", "key", "words"), [
    ("upstream: pulsar://b:6650\nlisten: 127.0.0.1:6650\nbogus: 1\n", 3, "bogus", "unknown key"),
    ("upstream: pulsar://b:6650\nlimits:\n  max_connections: 10\n  max_conns: 3\n", 4, "limits.max_conns",
     "unknown key"),
    ("upstream: pulsar://b:6650\nlimits:\n  max_connections: -1\n", 3, "limits.max_connections", "at least"),
    ("upstream: pulsar://b:6650\nlimits: {max_frame_bytes: lots}\n", 2, "limits.max_frame_bytes", "integer"),
    ("upstream: http://b:6650\n", 1, "upstream", "pulsar://"),
    ("listen: 127.0.0.1:6650\n", 1, "upstream", "required"),
    ("upstream: pulsar://b\nlisten: nowhere\n", 2, "listen", "HOST:PORT"),
    ("upstream: pulsar://b\nlookup: sideways\n", 2, "lookup", "rewrite, proxy-through"),
    ("upstream: pulsar://b\ntls:\n  cert: missing.pem\n", 3, "tls.cert", "readable"),
    ("upstream: pulsar://b\ntracing: {exporter: jaeger}\n", 2, "tracing.exporter", "one of"),
    ("upstream: pulsar://b\ntracing: {sample: 2}\n", 2, "tracing.sample", "at most"),
    ("upstream: pulsar://b\nrecord: {redact: maybe}\n", 2, "record.redact", "true or false"),
    ("upstream: pulsar://b\nrules: 5\n", 2, "rules", "rule file"),
    ("upstream: pulsar://b\nrules:\n  - name: a\n  - just-a-string\n", 4, "rules[1]", "mapping"),
    ("upstream: pulsar://b\nbroker_ports: 9000-8000\n", 2, "broker_ports", "START"),
    ("upstream: pulsar://b\nallowed_brokers:\n  - b:1\n  - nope\n", 4, "allowed_brokers[1]", "HOST:PORT"),
    ("upstream: pulsar://b\nupstream: pulsar://c\n", 2, "upstream", "duplicate"),
    ("upstream: pulsar://1\n", 1, "upstream", "'1' is not an IP address"),
    ("upstream: pulsar://10.0.0:6650\n", 1, "upstream", "'10.0.0' is not an IP address"),
    ("upstream: pulsar://b\nlisten: 127.0.0.256:6650\n", 2, "listen", "not an IP address"),
    ("upstream: pulsar://[::1::2]:6650\n", 1, "upstream", "not an IP address"),
    ("upstream: pulsar://b\nlimits: [1, 2\n", 3, "yaml", ""),
    ("- just\n- a list\n", 1, None, "mapping"),
])
def test_mistakes_name_file_line_and_key(tmp_path: Path, text: str, line: int, key: str | None,
                                         words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    error = caught.value
    assert (error.file, error.line, error.key) == (str(path), line, key)
    assert words in error.message
    assert error.format().startswith(f"{path}:{line}: ")


def test_inline_rules_keep_their_lines_for_the_rules_engine(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "upstream: pulsar://b\nrules:\n  - name: a\n    action: drop\n"))
    assert isinstance(config.rules, LineList) and config.rules.line_of(0) == 3
    assert isinstance(config.rules[0], LineMap) and config.rules[0].line_of("action") == 4


def test_the_loader_records_lines_of_keys_and_items() -> None:
    data = load_text("a: 1\nb:\n  c: [x, y]\n  d:\n    - 1\n    - 2\n")
    assert data.line_of("b") == 2 and data["b"].line_of("d") == 4 and data["b"]["d"].line_of(1) == 6


def test_an_unreadable_file_says_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(CannotRead) as caught:
        load_config(tmp_path / "absent.yaml")
    assert "cannot read" in caught.value.format()


def parse(*argv: str) -> object:
    parser, _ = build_parser()
    return parser.parse_args(["run", *argv])


def test_flags_alone_make_a_config_and_override_the_file(tmp_path: Path) -> None:
    config = load(parse("--upstream", "pulsar://b:1", "--listen", "0.0.0.0:7000", "--lookup", "proxy-through",
                        "--max-connections", "5", "--allow-broker", "b:2"))
    assert str(config.listen) == "0.0.0.0:7000" and config.lookup == "proxy-through"
    assert config.limits.max_connections == 5 and config.advertised_host == "127.0.0.1"
    path = write(tmp_path, "upstream: pulsar://file:1\nlisten: 127.0.0.1:1\nlimits: {max_connections: 9}\n")
    merged = load(parse("-c", str(path), "--listen", "127.0.0.1:2"))
    assert str(merged.listen) == "127.0.0.1:2" and str(merged.upstream) == "pulsar://file:1"
    assert merged.limits.max_connections == 9


def test_bad_flag_values_name_the_flag() -> None:
    with pytest.raises(UsageError, match="--listen"):
        load(parse("--upstream", "pulsar://b:1", "--listen", "nowhere"))
    with pytest.raises(UsageError, match="--upstream"):
        load(parse())


def test_run_refusing_a_config_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    path = write(tmp_path, "upstream: pulsar://b:6650\nlimits:\n  max_conns: 3\n")
    result = subprocess.run([sys.executable, "-m", "proxy", "run", "-c", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"{path}:3: limits.max_conns: unknown key (known keys: "
                                                  "drain_seconds, keepalive_seconds, max_connections, "
                                                  "max_frame_bytes, verify_checksums)"]


@pytest.mark.parametrize(("text", "host"), [
    ("10.0.0.7:6650", "10.0.0.7"), ("broker-1:6650", "broker-1"), ("1broker:6650", "1broker"),
    ("[::1]:6650", "::1"), ("localhost:0", "localhost"),
])
def test_hosts_of_every_form_parse_and_only_whole_addresses_of_digits(text: str, host: str) -> None:
    assert HostPort.parse(text).host == host

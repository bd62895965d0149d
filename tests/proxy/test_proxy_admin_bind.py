"""The admin API is never exposed beyond loopback by accident (issue #12, item 8).

``--admin 0.0.0.0:P`` with no token bound with no warning.  Now a non-loopback admin
address needs a token, or ``--insecure-admin`` (``admin.insecure: true``); either way
the proxy says at start what that exposes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli import build_parser, main
from proxy.cli.run import load
from proxy.config.proxy_config import HostPort, load_config
from proxy.errors import ConfigError

UPSTREAM = "pulsar://127.0.0.1:6650"


def test_a_non_loopback_admin_without_a_token_is_refused_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--upstream", UPSTREAM, "--admin", "0.0.0.0:9650"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "pulsar-tap run: error: --admin: 0.0.0.0:9650 is reachable from other machines and the admin API has "
        "no token: set admin.token_file (--admin-token-file), or admin.insecure: true (--insecure-admin) to let "
        "anyone who reaches it change the rules"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "admin.example"])
def test_the_config_key_says_file_line_and_key(tmp_path: Path, host: str) -> None:
    path = tmp_path / "proxy.yaml"
    listen = f"[{host}]:9650" if ":" in host else f"{host}:9650"
    path.write_text(f"upstream: {UPSTREAM}\nadmin:\n  listen: '{listen}'\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: admin.listen: .* has no token"):
        load_config(path)
    path.write_text(f"upstream: {UPSTREAM}\nadmin:\n  listen: '{listen}'\n  insecure: true\n")
    assert load_config(path).admin.insecure  # type: ignore[union-attr]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "localhost"])
def test_loopback_needs_no_token(host: str) -> None:
    listen = f"[{host}]:0" if ":" in host else f"{host}:0"
    parser, _ = build_parser()
    config = load(parser.parse_args(["run", "--upstream", UPSTREAM, "--admin", listen]))
    assert config.admin.listen == HostPort.parse(listen)


def run_until_ready(tmp_path: Path, *flags: str) -> str:
    """Start `pulsar-tap run` with these flags, wait for its ready file, stop it; its log."""
    ready = tmp_path / "ready.json"
    process = subprocess.Popen([sys.executable, "-m", "proxy", "run", "--upstream", UPSTREAM, "--listen",
                                "127.0.0.1:0", "--ready-file", str(ready), "--log-format", "json", *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("ready:") and ready.exists():
                break
        assert json.loads(ready.read_text())["admin"].endswith(tuple("0123456789"))
    finally:
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=30)
    return "".join(lines) + rest


def test_insecure_admin_starts_and_warns(tmp_path: Path) -> None:
    log = run_until_ready(tmp_path, "--admin", "0.0.0.0:0", "--insecure-admin")
    assert "admin API reachable from other machines with no token" in log


def test_a_token_on_a_non_loopback_admin_starts_and_warns_about_plain_http(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    log = run_until_ready(tmp_path, "--admin", "0.0.0.0:0", "--admin-token-file", str(token))
    assert "reachable from other machines over plain HTTP" in log
    assert "s3cret" not in log

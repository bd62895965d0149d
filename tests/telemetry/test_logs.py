"""structlog output: JSON or console, levels, bound connection context, and no secrets ever."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog

from proxy.errors import ConfigError
from proxy.telemetry.logs import (
    LEVELS,
    REDACTED,
    configure_logging,
    connection_context,
    is_secret_key,
    redact_text,
    writes,
)

TOKEN = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhZG1pbiJ9.c2VjcmV0LXNpZ25hdHVyZQ"
PASSWORD = "hunter2-very-secret"


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
    structlog.contextvars.clear_contextvars()


def log_everything_secret(logger: structlog.typing.FilteringBoundLogger) -> None:
    logger.info("connect", auth_data=TOKEN.encode(), auth_method_name="token", authData=TOKEN)
    logger.warning("upstream refused", headers={"Authorization": f"Bearer {TOKEN}", "Accept": "*/*"},
                   config={"tls": {"key_password": PASSWORD}, "admin": {"token": TOKEN}})
    logger.error(f"failed to call http://admin:{PASSWORD}@127.0.0.1:8080/ with token={TOKEN}")
    logger.info("clients", peers=[{"client_secret": PASSWORD}, {"name": "ok"}], api_key=PASSWORD)


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_secrets_never_appear_in_log_output(fmt: str) -> None:
    out = io.StringIO()
    configure_logging(fmt, "debug", stream=out)
    log_everything_secret(structlog.get_logger("test"))
    text = out.getvalue()
    assert text.count("\n") == 4
    assert TOKEN not in text and PASSWORD not in text
    assert "eyJ" not in text
    assert REDACTED in text
    assert "auth_method_name" in text and "token" in text  # the method's name is not a secret
    assert "127.0.0.1:8080" in text  # the rest of the message survives


def test_json_lines_carry_level_time_and_the_bound_connection_context() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    logger = structlog.get_logger("test")
    with connection_context(7, topic="persistent://public/default/orders", client="127.0.0.1:5000", broker=None):
        logger.info("producer created", producer="p-1")
    logger.info("after")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["event"] == "producer created"
    assert first["conn"] == 7 and first["topic"] == "persistent://public/default/orders"
    assert first["client"] == "127.0.0.1:5000" and "broker" not in first
    assert first["level"] == "info" and first["timestamp"].endswith("Z")
    assert "conn" not in second


def test_levels_filter() -> None:
    out = io.StringIO()
    configure_logging("json", "warning", stream=out)
    logger = structlog.get_logger("test")
    logger.info("hidden")
    logger.debug("hidden too")
    logger.warning("shown")
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["shown"]


def test_bad_format_or_level_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="log format"):
        configure_logging("xml")
    with pytest.raises(ConfigError, match="log level"):
        configure_logging("json", "loud")


def test_secret_key_and_text_detection() -> None:
    for key in ("auth_data", "authData", "original_auth_data", "token", "api-key", "Authorization", "password",
                "tls_private_key", "client_secret", "Cookie"):
        assert is_secret_key(key), key
    for key in ("topic", "auth_method_name", "producer_name", "token_file", "conn"):
        assert not is_secret_key(key), key
    masked = redact_text("Authorization: Basic dXNlcjpwYXNz")
    assert masked.startswith(f"Authorization: {REDACTED}") and "dXNlcjpwYXNz" not in masked
    assert redact_text("password='a b c' next") == f"password={REDACTED} next"


@pytest.mark.parametrize("configured", list(LEVELS))
def test_writes_says_whether_a_line_at_each_level_is_written(configured: str) -> None:
    """The relay asks before gathering a per-connection line's fields: the answer is what the setup writes."""
    out = io.StringIO()
    configure_logging("json", configured, stream=out)
    log = structlog.get_logger("test")
    for level in LEVELS:
        before = len(out.getvalue())
        getattr(log, level)("a line", conn=7)
        assert writes(level) == (len(out.getvalue()) > before), level
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(0))  # set up otherwise since
    assert all(writes(level) for level in LEVELS)

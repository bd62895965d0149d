"""Serving the admin app with hypercorn on Trio, on loopback unless told otherwise."""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from proxy.admin.app import AdminApp

DEFAULT_HOST = "127.0.0.1"


async def serve_admin(app: AdminApp, host: str = DEFAULT_HOST, port: int = 9650, *,
                      task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets the bound HOST:PORT list."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    app_any: Any = app
    await serve(app_any, config, task_status=task_status)

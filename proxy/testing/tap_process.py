"""The child process of ``Tap(process=True)``: one :class:`~proxy.testing.tap.TapServer`, driven over stdio.

Protocol (JSON, one object per line; every request gets one answer, ``{"ok": ...}``
or ``{"error": "message"}``):

- first line in: ``{"settings": TapSettings, "token": str | null}``; answer
  ``{"service_url", "admin_url"}`` once the proxy listens;
- ``{"op": "capture_begin"}`` -> the window id; ``{"op": "capture_end", "id": N}``
  -> the window (``CaptureWindow.to_json``);
- ``{"op": "stop"}``, or the end of stdin (the parent went away): the proxy shuts
  down and the process exits 0.

Logs go to stderr (the parent keeps them in a file).  Run as
``python -m proxy.testing.tap_process``; not a command for users.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from proxy.errors import PulsarTapError
from proxy.testing.tap import TapServer, TapSettings


def _answer(out: TextIO, value: dict[str, Any]) -> None:
    out.write(json.dumps(value) + "\n")
    out.flush()


def serve(stdin: TextIO, stdout: TextIO) -> int:
    from proxy.telemetry.logs import configure_logging

    configure_logging("console", "info", stream=sys.stderr)
    first = stdin.readline()
    if not first:
        return 0
    try:
        hello = json.loads(first)
        server = TapServer(TapSettings.from_json(hello["settings"]), hello.get("token"))
        server.start()
    except (PulsarTapError, ValueError, KeyError, TypeError) as exc:
        _answer(stdout, {"error": f"the tap did not start: {exc}"})
        return 2
    try:
        _answer(stdout, {"ok": {"service_url": server.service_url, "admin_url": server.admin_url}})
        for line in stdin:
            request = json.loads(line)
            op = request.get("op")
            if op == "stop":
                break
            try:
                if op == "capture_begin":
                    _answer(stdout, {"ok": server.capture_begin()})
                elif op == "capture_end":
                    _answer(stdout, {"ok": server.capture_end(int(request["id"])).to_json()})
                else:
                    _answer(stdout, {"error": f"unknown request {op!r}"})
            except PulsarTapError as exc:
                _answer(stdout, {"error": str(exc)})
    finally:
        server.close()
    return 0


def main() -> int:
    try:
        return serve(sys.stdin, sys.stdout)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""The sequence diagram of a recording: one self-contained HTML page, readable offline.

Each connection gets a section with three lanes, client / proxy / broker, like the
interaction diagrams of the Pulsar protocol documentation.  A frame the client
sent is an arrow from the client lane to the broker lane (passing the proxy, which
relayed it), a broker's frame goes the other way, and a frame the proxy changed or
originated starts at the proxy lane.  Labels carry the command, the key ids and,
on responses, the latency.  Plain inline SVG and CSS: no scripts, no fonts, no
network.  Very long connections are cut at :data:`MAX_FRAMES_PER_CONNECTION`
arrows, with a note saying how many were left out.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from proxy.errors import RecordingError
from proxy.pb import recording_pb2 as rpb
from proxy.recording.reader import LOOKUP_MODE_NAMES
from proxy.recording.timeline import TimelineEntry, summary_fields

MAX_FRAMES_PER_CONNECTION: Final = 1000
_LANE_X: Final = {"client": 190, "proxy": 520, "broker": 850}
_WIDTH: Final = 1000
_TOP: Final = 56
_STEP: Final = 30

_CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; background: #fff; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 2em; }
.meta { color: #555; font-size: 0.9em; }
svg { border: 1px solid #ddd; background: #fcfcfc; }
svg text { font-family: monospace; font-size: 11px; }
.lane { stroke: #999; stroke-dasharray: 4 3; }
.lanehead { font-family: sans-serif; font-size: 13px; font-weight: bold; }
.req { stroke: #1f6fb2; fill: #1f6fb2; } .resp { stroke: #2e8b57; fill: #2e8b57; }
.err { stroke: #c0392b; fill: #c0392b; } .proxy { stroke: #8e44ad; fill: #8e44ad; }
.label { stroke: none; fill: #222; } .time { stroke: none; fill: #888; font-size: 10px; }
.relay { fill: #fff; stroke-width: 1.5; }
"""


def _address(addr: rpb.Address) -> str:
    return f"{addr.host}:{addr.port}"


def _label(entry: TimelineEntry) -> str:
    text = entry.command
    fields = summary_fields(entry.fields)
    if entry.topic and entry.command in ("LOOKUP", "PARTITIONED_METADATA", "PRODUCER", "SUBSCRIBE"):
        text += f" {entry.topic}"
    if fields:
        text += f" {fields}"
    if entry.is_payload:
        text += f" [{entry.num_messages} msgs]"
    if entry.completed is not None:
        text += f" ({entry.completed.latency_ns / 1_000_000:.2f} ms"
        text += f", {entry.completed.error_code})" if entry.completed.error_code else ")"
    if entry.frame.rules:
        text += " rules:" + ",".join(entry.frame.rules)
    return text if len(text) <= 110 else text[:107] + "..."


def _arrow(y: int, entry: TimelineEntry, t0: int) -> str:
    frame = entry.frame
    start = "proxy" if frame.origin == "proxy" else ("client" if frame.direction == "to_broker" else "broker")
    end = "broker" if frame.direction == "to_broker" else "client"
    x1, x2 = _LANE_X[start], _LANE_X[end]
    if entry.command in ("ERROR", "SEND_ERROR") or (entry.completed and entry.completed.error_code) or entry.error:
        cls = "err"
    elif frame.origin == "proxy":
        cls = "proxy"
    else:
        cls = "req" if frame.direction == "to_broker" else "resp"
    tip = -8 if x2 > x1 else 8
    parts = [
        f'<g class="{cls}">',
        f'<line x1="{x1}" y1="{y}" x2="{x2}" y2="{y}" stroke-width="1.5"/>',
        f'<polygon points="{x2},{y} {x2 + tip},{y - 4} {x2 + tip},{y + 4}"/>',
    ]
    if start != "proxy":
        parts.append(f'<circle class="relay" cx="{_LANE_X["proxy"]}" cy="{y}" r="3"/>')
    label_x = min(x1, x2) + 6
    parts.append(f'<text class="label" x="{label_x}" y="{y - 5}">{html.escape(_label(entry))}</text>')
    elapsed_ms = (frame.ts_ns - t0) / 1_000_000
    parts.append(f'<text class="time" x="8" y="{y + 3}">+{elapsed_ms:.3f} ms</text>')
    parts.append("</g>")
    return "".join(parts)


def connection_svg(entries: Sequence[TimelineEntry]) -> str:
    """The lanes and arrows of one connection."""
    drawn = entries[:MAX_FRAMES_PER_CONNECTION]
    height = _TOP + _STEP * (len(drawn) + 1)
    t0 = drawn[0].frame.ts_ns if drawn else 0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
             f'viewBox="0 0 {_WIDTH} {height}">']
    for lane, x in _LANE_X.items():
        parts.append(f'<text class="lanehead" x="{x}" y="24" text-anchor="middle">{lane}</text>')
        parts.append(f'<line class="lane" x1="{x}" y1="34" x2="{x}" y2="{height - 8}"/>')
    for i, entry in enumerate(drawn):
        parts.append(_arrow(_TOP + _STEP * i + _STEP // 2, entry, t0))
    parts.append("</svg>")
    return "\n".join(parts)


def render_diagram(entries: Sequence[TimelineEntry], connections: Mapping[int, rpb.ConnectionInfo],
                   title: str = "") -> str:
    """The whole HTML page."""
    by_conn: dict[int, list[TimelineEntry]] = {}
    for entry in entries:
        by_conn.setdefault(entry.frame.conn, []).append(entry)
    body = [f"<h1>pulsar-tap sequence diagram{(': ' + html.escape(title)) if title else ''}</h1>",
            f'<p class="meta">{len(entries)} frames on {len(by_conn)} connections. '
            "Lanes: client, proxy, broker. Blue: client requests; green: broker responses; "
            "purple: frames the proxy changed or sent; red: errors.</p>"]
    if not by_conn:
        body.append("<p>No frames.</p>")
    for conn_id in sorted(by_conn):
        conn_entries = by_conn[conn_id]
        info = connections.get(conn_id)
        meta: list[str] = []
        if info is not None:
            if info.HasField("client"):
                meta.append(f"client {_address(info.client)}")
            if info.HasField("broker"):
                meta.append(f"broker {_address(info.broker)}")
            if info.HasField("lookup_mode"):
                meta.append(f"lookup {LOOKUP_MODE_NAMES.get(info.lookup_mode, 'unknown')}")
            if info.HasField("protocol_version"):
                meta.append(f"protocol v{info.protocol_version}")
        meta.append(f"{len(conn_entries)} frames")
        body.append(f'<h2 id="conn-{conn_id}">Connection {conn_id}</h2>')
        body.append(f'<p class="meta">{html.escape(", ".join(meta))}</p>')
        body.append(connection_svg(conn_entries))
        if len(conn_entries) > MAX_FRAMES_PER_CONNECTION:
            body.append(f'<p class="meta">... {len(conn_entries) - MAX_FRAMES_PER_CONNECTION} more frames '
                        "not drawn (use show --conn/--command/--topic to narrow).</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>pulsar-tap: {html.escape(title or 'recording')}</title>\n<style>{_CSS}</style>\n"
            "</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")


def write_diagram(path: Path, entries: Sequence[TimelineEntry], connections: Mapping[int, rpb.ConnectionInfo],
                  title: str = "") -> None:
    try:
        path.write_text(render_diagram(entries, connections, title), encoding="utf-8")
    except OSError as exc:
        raise RecordingError(f"{path}: cannot write: {exc.strerror or exc}") from None


__all__ = ["MAX_FRAMES_PER_CONNECTION", "connection_svg", "render_diagram", "write_diagram"]

"""The analytics report: a text table for the terminal and a self-contained HTML page.

Sections: per-command latency percentiles (p50/p90/p99/max, µs), top topics by
bytes and messages, error counts by code, throughput over time.  The HTML page
draws its plots as inline SVG, so it needs no network and no plotting library.
"""

from __future__ import annotations

import html
from typing import Any

from proxy.analytics.pipeline import AnalyzeResult


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths,
                                                                                        strict=True)))]
    out.append("  ".join("-" * w for w in widths))
    for row in cells:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return out


def _sections(result: AnalyzeResult) -> list[tuple[str, list[str], list[list[Any]]]]:
    return [
        ("Request latency (µs)", ["command", "count", "p50", "p90", "p99", "max"],
         [[r["request_command"], r["count"], r["p50"], r["p90"], r["p99"], r["max"]] for r in result.latency]),
        ("Top topics", ["topic", "messages in", "bytes in", "messages out", "bytes out"],
         [[r["topic"], r["messages_in"], r["bytes_in"], r["messages_out"], r["bytes_out"]]
          for r in result.top_topics]),
        ("Errors by code", ["code", "count"], [[r["code"], r["count"]] for r in result.error_counts]),
    ]


def text_report(result: AnalyzeResult) -> str:
    lines = [f"pulsar-tap analyze: {result.segments} segments, {result.input_bytes / 2**20:,.1f} MiB "
             f"-> {result.out}"]
    tables = ", ".join(f"{name} {result.counts.get(name, 0):,}" for name in
                       ("frames", "requests", "messages", "errors", "replication"))
    lines.append(f"rows: {tables}")
    for title, headers, rows in _sections(result):
        lines += ["", title]
        lines += _table(headers, rows) if rows else ["  (none)"]
    if result.throughput:
        lines += ["", "Throughput (messages per second, in / out)"]
        start = result.throughput[0]["second"]
        peak = max(r["messages_in"] + r["messages_out"] for r in result.throughput) or 1
        for r in result.throughput[:60]:
            bar = "#" * int(40 * (r["messages_in"] + r["messages_out"]) / peak)
            lines.append(f"  +{r['second'] - start:>5}s {r['messages_in']:>9,} / {r['messages_out']:<9,} {bar}")
        if len(result.throughput) > 60:
            lines.append(f"  ... {len(result.throughput) - 60} more seconds in the HTML report")
    if result.problems:
        lines += ["", "Skipped input"] + [f"  {p}" for p in result.problems]
    return "\n".join(lines) + "\n"


def _svg_line_chart(points: list[tuple[float, float]], series2: list[tuple[float, float]] | None,
                    title: str, width: int = 720, height: int = 220) -> str:
    if not points:
        return "<p>(no data)</p>"
    pad = 40
    xs = [p[0] for p in points]
    ys = [p[1] for p in points] + [p[1] for p in (series2 or [])]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y1 = max(ys) or 1

    def path(series: list[tuple[float, float]]) -> str:
        return " ".join(f"{pad + (x - x0) / (x1 - x0) * (width - 2 * pad):.1f},"
                        f"{height - pad - y / y1 * (height - 2 * pad):.1f}" for x, y in series)

    lines = [f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{path(points)}"/>']
    if series2:
        lines.append(f'<polyline fill="none" stroke="#ff7f0e" stroke-width="2" points="{path(series2)}"/>')
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">'
            f'<rect width="100%" height="100%" fill="#fafafa"/>'
            f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#888"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#888"/>'
            f'<text x="{pad}" y="{pad - 10}" font-size="12">{html.escape(title)} (max {_fmt(y1)})</text>'
            f'<text x="{width - pad}" y="{height - 10}" font-size="11" text-anchor="end">seconds</text>'
            + "".join(lines) + "</svg>")


def _svg_bars(items: list[tuple[str, float]], title: str, width: int = 720) -> str:
    if not items:
        return "<p>(no data)</p>"
    bar_h, label_w = 22, 220
    top = max(v for _, v in items) or 1
    height = bar_h * len(items) + 30
    bars = []
    for i, (label, value) in enumerate(items):
        y = 25 + i * bar_h
        w = (width - label_w - 90) * value / top
        bars.append(f'<text x="{label_w - 6}" y="{y + 15}" font-size="11" text-anchor="end">'
                    f'{html.escape(label[-34:])}</text><rect x="{label_w}" y="{y + 3}" width="{w:.1f}" '
                    f'height="{bar_h - 6}" fill="#2ca02c"/><text x="{label_w + w + 4:.1f}" y="{y + 15}" '
                    f'font-size="11">{_fmt(value)}</text>')
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">'
            f'<text x="4" y="14" font-size="12">{html.escape(title)}</text>' + "".join(bars) + "</svg>")


def html_report(result: AnalyzeResult) -> str:
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>pulsar-tap analyze</title><style>",
             "body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:.5em 0}",
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child,th:first-child"
             "{text-align:left}h2{margin-top:1.5em}</style></head><body>",
             "<h1>pulsar-tap analyze</h1>",
             f"<p>{result.segments} segments, {result.input_bytes / 2**20:,.1f} MiB read; tables written to "
             f"<code>{html.escape(str(result.out))}</code>.</p>"]
    for title, headers, rows in _sections(result):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if not rows:
            parts.append("<p>(none)</p>")
            continue
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>")
        for row in rows:
            parts.append("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>")
        parts.append("</table>")
        if title.startswith("Request latency"):
            parts.append(_svg_bars([(r["request_command"], r["p99"] or 0.0) for r in result.latency],
                                   "p99 latency by command (µs)"))
        if title == "Top topics":
            parts.append(_svg_bars([(r["topic"], float(r["bytes_in"] + r["bytes_out"]))
                                    for r in result.top_topics], "bytes by topic"))
    parts.append("<h2>Throughput over time</h2>")
    if result.throughput:
        start = result.throughput[0]["second"]
        parts.append(_svg_line_chart([(r["second"] - start, r["messages_in"]) for r in result.throughput],
                                     [(r["second"] - start, r["messages_out"]) for r in result.throughput],
                                     "messages per second: in (blue), out (orange)"))
    else:
        parts.append("<p>(no data)</p>")
    if result.problems:
        parts.append("<h2>Skipped input</h2><ul>" + "".join(f"<li>{html.escape(p)}</li>" for p in result.problems)
                     + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)

"""The analytics report: a text version for the terminal and a self-contained HTML page.

Sections: request latency per command (count, p50/p90/p99/max in µs, and in the page a
CDF per command), the slowest 20 requests with their connection and topic, top topics
(messages and bytes in = produced, SEND from clients; out = delivered, MESSAGE to
consumers), errors by code and over time, throughput over time, replication lag over
time (when the recording holds geo-replicated traffic) and the input skipped.

The page draws its plots as inline SVG (no network, no plotting library).  Time series
are broken where nothing happened: an idle stretch is shaded and labelled, never drawn
as a line between the traffic on either side of it.  Labels are written in full, the
plot's margin made as wide as the longest one.
"""

from __future__ import annotations

import html
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

from proxy.analytics.figures import Figures
from proxy.analytics.steps import AnalyzeResult
from proxy.wording import counted

#: Series wider than this many seconds are drawn in bins (the label says how wide).
MAX_POINTS: Final = 1800
_COLORS: Final = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf")
_FONT: Final = "font-family:ui-monospace,Menlo,Consolas,monospace"
_CHAR_W: Final = 6.7  # width of one character of the 11 px monospace font


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return "-"
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths,
                                                                                                strict=True)))

    return [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in cells)]


# -- the figures, as rows ---------------------------------------------------------------------
def latency_rows(figures: Figures) -> list[list[Any]]:
    ordered = sorted(figures.latencies.items(), key=lambda item: (-item[1].count, item[0]))
    return [[command, stats.count, stats.quantile(0.5), stats.quantile(0.9), stats.quantile(0.99), stats.max]
            for command, stats in ordered]


def slowest_rows(figures: Figures) -> list[list[Any]]:
    return [[f"{latency:,.1f}", command, error or response or outcome, f"{recording}#{conn}", topic or "-",
             _when(start)] for latency, recording, conn, command, response, topic, start, outcome, error
            in figures.slowest]


def topic_rows(figures: Figures, limit: int = 10) -> list[list[Any]]:
    if figures.throughput is None or not figures.throughput.num_rows:
        return []
    grouped = figures.throughput.group_by("topic").aggregate(
        [(name, "sum") for name in ("messages_in", "bytes_in", "messages_out", "bytes_out")]).to_pylist()
    grouped.sort(key=lambda r: (-(r["bytes_in_sum"] + r["bytes_out_sum"]), r["topic"]))
    return [[r["topic"], r["messages_in_sum"], r["bytes_in_sum"], r["messages_out_sum"], r["bytes_out_sum"]]
            for r in grouped[:limit]]


def error_rows(figures: Figures) -> list[list[Any]]:
    totals: dict[str, int] = defaultdict(int)
    for (_second, code), count in figures.errors.items():
        totals[code] += count
    return [[code, count] for code, count in sorted(totals.items(), key=lambda item: (-item[1], item[0]))]


def per_second(figures: Figures) -> list[tuple[int, int, int, int, int]]:
    """(second, messages in, messages out, bytes in, bytes out) for every second with traffic."""
    if figures.throughput is None or not figures.throughput.num_rows:
        return []
    grouped = figures.throughput.group_by("second").aggregate(
        [(name, "sum") for name in ("messages_in", "messages_out", "bytes_in", "bytes_out")])
    rows = sorted(zip(*(grouped[c].to_pylist() for c in ("second", "messages_in_sum", "messages_out_sum",
                                                            "bytes_in_sum", "bytes_out_sum")), strict=True))
    return [(int(a), int(b), int(c), int(d), int(e)) for a, b, c, d, e in rows]


def _sections(figures: Figures) -> list[tuple[str, list[str], list[list[Any]]]]:
    return [
        ("Request latency (µs)", ["command", "count", "p50", "p90", "p99", "max"], latency_rows(figures)),
        (f"Slowest {len(figures.slowest)} requests", ["latency µs", "command", "answer", "connection", "topic",
                                                      "sent at"], slowest_rows(figures)),
        ("Top topics (in = produced by clients, out = delivered to consumers)",
         ["topic", "messages in", "bytes in", "messages out", "bytes out"], topic_rows(figures)),
        ("Errors by code", ["code", "count"], error_rows(figures)),
    ]


def text_report(result: AnalyzeResult) -> str:
    figures = result.figures
    lines = [f"pulsar-tap analyze: {counted(result.segments, 'segment')}, {result.input_bytes / 2**20:,.1f} MiB, "
             f"{counted(result.frames_read, 'frame', grouped=True)} read -> {result.out}"]
    tables = ", ".join(f"{name} {figures.counts.get(name, 0):,}" for name in
                       ("frames", "requests", "messages", "errors", "replication"))
    lines.append(f"rows: {tables}")
    for title, headers, rows in _sections(figures):
        lines += ["", title]
        lines += _table(headers, rows) if rows else ["  (none)"]
    seconds = per_second(figures)
    if seconds:
        lines += ["", "Throughput (messages per second, in = produced / out = delivered)"]
        start = seconds[0][0]
        peak = max(r[1] + r[2] for r in seconds) or 1
        previous = None
        for second, m_in, m_out, _b_in, _b_out in seconds[:60]:
            if previous is not None and second - previous > 1:
                lines.append(f"  ... idle for {second - previous - 1:,} s")
            bar = "#" * round(40 * (m_in + m_out) / peak)
            lines.append(f"  +{second - start:>6,}s  in {m_in:>9,}  out {m_out:>9,}  {bar}")
            previous = second
        if len(seconds) > 60:
            lines.append(f"  ... {len(seconds) - 60:,} more seconds with traffic in the HTML report")
    if figures.replication_lag:
        lines += ["", "Replication lag (ms, capture time minus publish time of replicated messages)"]
        lines += _table(["topic", "messages", "mean", "max"], _lag_by_topic(figures))
    if figures.skipped:
        lines += ["", "Skipped input"] + [f"  {p}" for p in figures.skipped]
    return "\n".join(lines) + "\n"


def _lag_by_topic(figures: Figures) -> list[list[Any]]:
    totals: dict[str, list[float]] = {}
    for (_second, topic), (count, total, peak) in figures.replication_lag.items():
        entry = totals.setdefault(topic, [0, 0.0, -math.inf])
        entry[0] += count
        entry[1] += total
        entry[2] = max(entry[2], peak)
    return [[topic, int(c), t / c if c else None, p] for topic, (c, t, p) in sorted(totals.items())]


# -- SVG ----------------------------------------------------------------------------------------
def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exponent = 10 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        if value <= step * exponent:
            return float(step * exponent)
    return float(10 * exponent)


def _tick(value: float, integer: bool) -> str:
    if integer or value >= 100:
        return f"{round(value):,}"
    return f"{value:,.2f}".rstrip("0").rstrip(".")


def _svg_frame(title: str, width: int, height: int, body: list[str]) -> str:
    return (f'<svg class="plot" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{html.escape(title)}" style="{_FONT}"><rect width="100%" height="100%" fill="#fcfcfc"/>'
            + "".join(body) + "</svg>")


def svg_time_series(series: list[tuple[str, list[tuple[float, float]]]], title: str, y_label: str, *,
                    integer: bool = True, width: int = 860, height: int = 260, max_gap: float = 1.0,
                    log_x: bool = False, x_label: str = "seconds since the first frame") -> str:
    """Lines over x; a line is broken wherever consecutive points are more than ``max_gap`` apart."""
    points = [p for _, pts in series for p in pts]
    if not points:
        return "<p>(no data)</p>"
    left, right, top, bottom = 70, 20, 34, 44
    axis = _Axis([p[0] for p in points], log_x, max_gap)
    y1 = _nice_max(max(p[1] for p in points))
    plot_w = width - left - right

    def sx(x: float) -> float:
        return left + axis.fraction(x) * plot_w

    def sy(y: float) -> float:
        return height - bottom - y / y1 * (height - top - bottom)

    body = [f'<text x="{left}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
            f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#888"/>',
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#888"/>',
            f'<text x="{width - right}" y="{height - 8}" font-size="11" text-anchor="end">'
            f'{html.escape(x_label)}</text>',
            f'<text x="6" y="{top - 8}" font-size="11">{html.escape(y_label)}</text>']
    for i in range(5):
        value = y1 * i / 4
        body.append(f'<text x="{left - 4}" y="{sy(value) + 4:.1f}" font-size="10" text-anchor="end">'
                    f'{_tick(value, integer)}</text>')
        body.append(f'<line x1="{left}" y1="{sy(value):.1f}" x2="{width - right}" y2="{sy(value):.1f}" '
                    f'stroke="#eee"/>')
    for x in axis.ticks():
        label = _tick(x, False) if log_x else _tick(x, True)
        body.append(f'<text x="{sx(x):.1f}" y="{height - bottom + 14}" font-size="10" text-anchor="middle">'
                    f'{label}</text>')
    for a, b, compressed in axis.idle:  # idle stretches: shaded, labelled, never bridged by a line
        body.append(f'<rect class="idle" x="{sx(a):.1f}" y="{top}" width="{max(1.0, sx(b) - sx(a)):.1f}" '
                    f'height="{height - top - bottom}" fill="{"#dcdcdc" if compressed else "#ececec"}"/>')
        if sx(b) - sx(a) > 40:
            body.append(f'<text x="{(sx(a) + sx(b)) / 2:.1f}" y="{top + 14}" font-size="10" text-anchor="middle" '
                        f'fill="#555">idle {_tick(b - a - 1, True)} s</text>')
        if compressed:
            body.append(f'<text x="{(sx(a) + sx(b)) / 2:.1f}" y="{height - bottom + 4}" font-size="12" '
                        f'text-anchor="middle" fill="#555">≈</text>')
    for index, (_name, pts) in enumerate(series):
        color = _COLORS[index % len(_COLORS)]
        run: list[tuple[float, float]] = []
        for point in sorted(pts):
            if run and point[0] - run[-1][0] > max_gap:
                body.append(_polyline(run, sx, sy, color))
                run = []
            run.append(point)
        body.append(_polyline(run, sx, sy, color))
    # the legend, one entry per line under the plot: never wider than the plot, never cut
    for index, (name, _pts) in enumerate(series):
        body.append(f'<text x="{left}" y="{height + 16 + index * 15}" font-size="11" '
                    f'fill="{_COLORS[index % len(_COLORS)]}">■ {html.escape(name)}</text>')
    height += 8 + 15 * len(series)
    width = max(width, int(left + 20 + max(len(name) + 2 for name, _ in series) * _CHAR_W))
    return _svg_frame(title, width, height, body)


class _Axis:
    """An x axis that draws long idle stretches narrow (shaded and labelled), so traffic stays readable."""

    def __init__(self, xs: list[float], log_x: bool, max_gap: float) -> None:
        self.log_x = log_x
        values = sorted({math.log10(max(x, 1e-3)) if log_x else x for x in xs})
        self.lo, self.hi = values[0], max(values[-1], values[0] + 1e-9)
        #: (start, end, compressed) of every idle stretch (time axes only)
        self.idle: list[tuple[float, float, bool]] = []
        self._cuts: list[tuple[float, float]] = []  # (start, end) of the compressed stretches
        if log_x:
            return
        span = self.hi - self.lo
        for a, b in itertools.pairwise(values):
            if b - a > max_gap * 2:
                compressed = b - a > max(span * 0.2, max_gap * 20)
                self.idle.append((a, b, compressed))
                if compressed:
                    self._cuts.append((a, b))
        # every stretch of traffic gets room, even a single second of it
        kept = max(span - sum(b - a for a, b in self._cuts), max_gap * 8 * (len(self._cuts) + 1))
        self._gap_width = kept * 0.08  # a compressed stretch is drawn 8 % as wide as the traffic
        self._total = kept + self._gap_width * len(self._cuts)

    def _virtual(self, value: float) -> float:
        shift = 0.0
        for a, b in self._cuts:
            if value >= b:
                shift += (b - a) - self._gap_width
            elif value > a:
                shift += (value - a) * (1 - self._gap_width / (b - a))
        return value - self.lo - shift

    def fraction(self, x: float) -> float:
        value = math.log10(max(x, 1e-3)) if self.log_x else x
        if self.log_x or not self._cuts:
            return (value - self.lo) / (self.hi - self.lo)
        return self._virtual(value) / self._total

    def ticks(self) -> list[float]:
        if self.log_x:
            return [10 ** (self.lo + (self.hi - self.lo) * i / 5) for i in range(6)]
        if not self._cuts:
            return [self.lo + (self.hi - self.lo) * i / 5 for i in range(6)]
        edges = [self.lo] + [v for cut in self._cuts for v in cut] + [self.hi]
        return sorted(set(edges))


def _polyline(run: list[tuple[float, float]], sx: Any, sy: Any, color: str) -> str:
    if len(run) == 1:
        x, y = run[0]
        return f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>'
    points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in run)
    return f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{points}"/>'


def svg_bars(items: list[tuple[str, float]], title: str, unit: str, *, integer: bool = True, width: int = 860) -> str:
    """Horizontal bars; the label column is as wide as the longest label (never cut)."""
    if not items:
        return "<p>(no data)</p>"
    bar_h = 22
    label_w = max(len(label) for label, _ in items) * _CHAR_W + 16
    value_w = max(len(_tick(v, integer)) for _, v in items) * _CHAR_W + 60
    width = max(width, int(label_w + value_w + 200))
    top = max(v for _, v in items) or 1
    height = bar_h * len(items) + 34
    body = [f'<text x="4" y="16" font-size="13" font-weight="bold">{html.escape(title)} ({html.escape(unit)})</text>']
    for i, (label, value) in enumerate(items):
        y = 26 + i * bar_h
        w = (width - label_w - value_w) * value / top
        body.append(f'<text x="{label_w - 8:.1f}" y="{y + 15}" font-size="11" text-anchor="end">'
                    f'{html.escape(label)}</text><rect class="bar" x="{label_w:.1f}" y="{y + 3}" '
                    f'width="{max(w, 1):.1f}" '
                    f'height="{bar_h - 6}" fill="#2ca02c"/><text x="{label_w + w + 6:.1f}" y="{y + 15}" '
                    f'font-size="11">{_tick(value, integer)} {html.escape(unit)}</text>')
    return _svg_frame(title, width, height, body)


def _binned(rows: list[tuple[int, ...]], start: int) -> tuple[int, list[tuple[float, ...]]]:
    """Per-second rows summed into bins so that at most MAX_POINTS remain; values become per-second means."""
    span = rows[-1][0] - start + 1
    width = max(1, math.ceil(span / MAX_POINTS))
    if width == 1:
        return 1, [tuple(float(v) for v in (r[0] - start, *r[1:])) for r in rows]
    bins: dict[int, list[int]] = {}
    for second, *values in rows:
        acc = bins.setdefault((second - start) // width * width, [0] * len(values))
        for i, v in enumerate(values):
            acc[i] += v
    return width, [(float(b), *(v / width for v in acc)) for b, acc in sorted(bins.items())]


def html_report(result: AnalyzeResult) -> str:
    figures = result.figures
    counts = ", ".join(f"{name} {figures.counts.get(name, 0):,}" for name in
                       ("frames", "requests", "messages", "errors", "replication"))
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>pulsar-tap analyze</title><style>",
             "body{font-family:sans-serif;margin:2em;color:#222;max-width:1100px}"
             "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
             "text-align:right;white-space:nowrap}td:first-child,th:first-child{text-align:left}"
             "h2{margin-top:1.6em}svg.plot{display:block;margin:.8em 0;max-width:none}"
             ".note{color:#555;font-size:90%}</style></head><body>",
             "<h1>pulsar-tap analyze</h1>",
             f"<p>{counted(result.segments, 'segment')}, {result.input_bytes / 2**20:,.1f} MiB, "
             f"{counted(result.frames_read, 'frame', grouped=True)} read; tables written to "
             f"<code>{html.escape(str(result.out))}</code>.<br>Rows: {counts}.</p>"]
    for title, headers, rows in _sections(figures):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if not rows:
            parts.append("<p>(none)</p>")
            continue
        if title.startswith("Request latency"):
            parts.append(svg_time_series(
                [(command, stats.cdf()) for command, stats in sorted(figures.latencies.items(),
                                                                     key=lambda i: -i[1].count)[:len(_COLORS)]],
                "Latency CDF per command", "fraction of requests", integer=False, log_x=True,
                max_gap=math.inf, x_label="latency, µs (log scale)"))
            parts.append(svg_bars([(r[0], float(r[4])) for r in rows], "p99 latency by command", "µs",
                                  integer=False))
        if title.startswith("Top topics"):
            parts.append(svg_bars([(r[0], float(r[2] + r[4])) for r in rows], "bytes by topic, in + out", "bytes"))
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>")
        for row in rows:
            parts.append("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>")
        parts.append("</table>")
    parts += _time_sections(figures)
    if figures.skipped:
        parts.append("<h2>Skipped input</h2><ul>" + "".join(f"<li>{html.escape(p)}</li>" for p in figures.skipped)
                     + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _time_sections(figures: Figures) -> list[str]:
    parts = ["<h2>Throughput over time</h2>"]
    seconds = per_second(figures)
    errors = sorted(figures.errors.items())
    lags = sorted(figures.replication_lag.items())
    starts = [r[0] for r in seconds[:1]] + [k[0] for k, _ in errors[:1]] + [k[0] for k, _ in lags[:1]]
    start = min(starts) if starts else 0
    if seconds:
        width, rows = _binned([tuple(r) for r in seconds], start)
        unit = "per second" if width == 1 else f"per second, mean over {width} s bins"
        parts.append(svg_time_series([("in (produced)", [(r[0], r[1]) for r in rows]),
                                      ("out (delivered)", [(r[0], r[2]) for r in rows])],
                                     f"Messages {unit}", "messages/s", integer=width == 1, max_gap=width))
        parts.append(svg_time_series([("in (produced)", [(r[0], r[3]) for r in rows]),
                                      ("out (delivered)", [(r[0], r[4]) for r in rows])],
                                     f"Bytes on the wire {unit} (whole frames)", "bytes/s", integer=width == 1,
                                     max_gap=width))
    else:
        parts.append("<p>(no data)</p>")
    parts.append("<h2>Errors over time</h2>")
    if errors:
        by_code: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for (second, code), count in errors:
            by_code[code].append((float(second - start), float(count)))
        parts.append(svg_time_series(sorted(by_code.items(), key=lambda i: -sum(c for _, c in i[1]))[:len(_COLORS)],
                                     "Errors per second, by code", "errors/s"))
    else:
        parts.append("<p>(none)</p>")
    if lags:
        parts.append("<h2>Replication lag over time</h2>")
        by_topic: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for (second, topic), (lagged, total, peak) in lags:
            by_topic[f"{topic} mean"].append((float(second - start), total / lagged))
            by_topic[f"{topic} max"].append((float(second - start), peak))
        parts.append(svg_time_series(sorted(by_topic.items())[:len(_COLORS)],
                                     "Replication lag (capture time minus publish time)", "ms", integer=False))
        markers = sorted(figures.markers.items())
        if markers:
            kinds: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for (second, kind), marker_count in markers:
                kinds[kind].append((float(second - start), float(marker_count)))
            parts.append(svg_time_series(sorted(kinds.items()), "Replication markers per second", "markers/s"))
    return parts


__all__ = ["html_report", "latency_rows", "per_second", "slowest_rows", "svg_bars", "svg_time_series",
           "text_report", "topic_rows"]

"""The HTML report as a user sees it: rendered in headless Chromium, plots drawn, nothing cut, gaps not bridged."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from proxy.analytics.report import html_report, svg_time_series, text_report
from proxy.analytics.steps import AnalyzeResult, analyze_in_process
from proxy.analytics.synthetic import Features, write_synthetic_recording

ROOT = Path(__file__).resolve().parents[2]

#: Measures every plot once the page is laid out and leaves the result in the DOM for --dump-dom.
_PROBE = """
<script>
window.addEventListener("load", () => {
  const plots = [...document.querySelectorAll("svg.plot")].map((svg) => {
    const box = svg.getBoundingClientRect();
    const marks = [...svg.querySelectorAll("polyline, circle, rect.bar")]
      .map((m) => m.getBBox()).filter((b) => b.width > 0 || b.height > 0).length;
    const cut = [...svg.querySelectorAll("text")].filter((t) => {
      const b = t.getBoundingClientRect();
      return b.left < box.left - 0.5 || b.right > box.right + 0.5
        || b.top < box.top - 0.5 || b.bottom > box.bottom + 0.5;
    }).map((t) => t.textContent);
    return {label: svg.getAttribute("aria-label"), marks, cut, width: box.width, height: box.height};
  });
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(plots);
  document.body.appendChild(pre);
});
</script>
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, AnalyzeResult]:
    """Two recordings 386 s apart (an idle gap), with replication and errors, analysed in one process."""
    base = tmp_path_factory.mktemp("recordings")
    features = Features(chunked=True, replication=True)
    write_synthetic_recording(base, 2 * 2**20, connections=8, segment_bytes=2**20, features=features)
    write_synthetic_recording(base, 2**20, connections=6, seed=3, name="20251122T084000Z-3",
                              start_ns=1_763_800_000_000_000_000 + 386 * 10**9 + 4 * 10**9, features=features)
    out = tmp_path_factory.mktemp("analysis")
    result = analyze_in_process([str(base)], str(out))
    (out / "report.html").write_text(html_report(result), encoding="utf-8")
    (out / "report.txt").write_text(text_report(result), encoding="utf-8")
    return out, result


def test_the_throughput_line_breaks_over_idle_gaps_and_shades_them(report: tuple[Path, AnalyzeResult]) -> None:
    page = (report[0] / "report.html").read_text()
    throughput = page[page.index('aria-label="Messages per second"'):]
    throughput = throughput[:throughput.index("</svg>")]
    assert 'class="idle"' in throughput and "idle 38" in throughput  # the 386-ish s gap, labelled
    xs = [[float(p.split(",")[0]) for p in pts.split()] for pts in re.findall(r'points="([^"]+)"', throughput)]
    idle = re.search(r'class="idle" x="([\d.]+)" y="\d+" width="([\d.]+)"', throughput)
    assert idle is not None
    left, right = float(idle.group(1)), float(idle.group(1)) + float(idle.group(2))
    for line in xs:  # no line has points on both sides of the gap
        assert not (min(line) < left + 0.5 and max(line) > right - 0.5)
    text = (report[0] / "report.txt").read_text()
    assert re.search(r"idle for 38\d s", text)


def test_counts_are_integers_and_units_and_directions_are_stated(report: tuple[Path, AnalyzeResult]) -> None:
    page = (report[0] / "report.html").read_text()
    assert "messages/s" in page and "bytes/s" in page and "in (produced)" in page and "out (delivered)" in page
    assert "latency, µs" in page and "Replication lag" in page and "Errors per second, by code" in page
    throughput = page[page.index('aria-label="Messages per second"'):]
    ticks = re.findall(r'font-size="10" text-anchor="end">([^<]+)</text>', throughput[:throughput.index("</svg>")])
    assert len(ticks) == 5 and all(re.fullmatch(r"[\d,]+", t) for t in ticks), ticks


def test_a_long_label_is_written_in_full() -> None:
    from proxy.analytics.report import svg_bars

    label = "persistent://public/default/ptopic-partition-1"
    svg = svg_bars([(label, 5.0), ("short", 3.0)], "bytes by topic", "bytes")
    assert f">{label}</text>" in svg
    assert "(no data)" in svg_time_series([], "t", "y")


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (bash scripts/setup.sh, or apt-get install -y chromium)")
def test_the_report_renders_in_headless_chromium_with_every_plot_drawn(report: tuple[Path, AnalyzeResult]) -> None:
    out = report[0]
    probed = out / "probed.html"
    probed.write_text((out / "report.html").read_text().replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    base = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1200,5200", "--virtual-time-budget=5000"]
    dom = subprocess.run([*base, "--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=180)
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert match, dom.stderr[-2000:]
    plots: list[dict[str, Any]] = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    labels = {p["label"] for p in plots}
    assert {"Latency CDF per command", "p99 latency by command", "bytes by topic, in + out", "Messages per second",
            "Bytes on the wire per second (whole frames)", "Errors per second, by code",
            "Replication lag (capture time minus publish time)"} <= labels, labels
    for plot in plots:
        assert plot["marks"] > 0, plot        # something is drawn
        assert plot["cut"] == [], plot        # no label runs outside its plot
        assert plot["width"] > 300 and plot["height"] > 60, plot
    png = out / "report.png"
    subprocess.run([*base, f"--screenshot={png}", (out / "report.html").as_uri()], capture_output=True, timeout=180)
    assert png.exists() and png.stat().st_size > 50_000

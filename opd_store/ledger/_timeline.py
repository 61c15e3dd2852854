"""``opd-store report --html FILE``: one self-contained page with the run's timeline (plotly).

The page holds its own copy of plotly.js (``include_plotlyjs=True``), so it opens without network
(a laptop on a plane, a cluster without egress). One row per start; one marker per timeline item of
the report (:class:`~opd_store.ledger._report.TimelineItem`: starts, saves, notices, kills, exits),
each kind a trace of its own; lost work (from the step the next start resumed from to the kill) as
a thick red segment per preemption. Above the plot, the report's summary as an HTML table. plotly is
the ``html`` extra (``pip install 'opd_store[html]'``).
"""

from __future__ import annotations

import datetime as dt
import html

from ._report import LedgerReport, report_lines

_STYLE = {  # kind -> (marker symbol, colour)
    "start": ("triangle-right", "#2b8a3e"),
    "save": ("circle", "#1c7ed6"),
    "notice": ("diamond", "#f59f00"),
    "kill": ("x", "#c92a2a"),
    "exit": ("square", "#495057"),
}


def _when(secs: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(secs, dt.timezone.utc)


def timeline_figure(report: LedgerReport):
    """The plotly figure of the report's timeline.

    Raises:
        ImportError: plotly is not installed (the ``html`` extra).
    """
    try:
        import plotly.graph_objects as go
    except ImportError as exc:
        raise ImportError("--html needs plotly: pip install 'opd_store[html]'") from exc
    figure = go.Figure()
    rows = [f"start {row.index}" for row in report.starts]
    for kind, (symbol, colour) in _STYLE.items():
        items = [item for item in report.timeline if item.kind == kind]
        if not items:
            continue
        figure.add_trace(go.Scatter(
            x=[_when(item.time_secs) for item in items], y=[f"start {item.start_index}" for item in items],
            mode="markers", name=kind, text=[item.label for item in items], hoverinfo="text+x",
            marker={"symbol": symbol, "size": 12, "color": colour, "line": {"width": 1, "color": "#212529"}}))
    for index, lost in enumerate(report.lost_work):
        figure.add_trace(go.Scatter(
            x=[_when(lost.from_secs), _when(lost.to_secs)], y=[f"start {lost.start_index}"] * 2, mode="lines",
            name="lost work", legendgroup="lost work", showlegend=index == 0,
            line={"color": "rgba(201, 42, 42, 0.35)", "width": 14},
            hovertext=f"{lost.updates} updates lost", hoverinfo="text"))
    figure.update_layout(
        title=f"opd_store run timeline: {report.url}", xaxis_title="time (UTC)",
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(rows)), "title": ""},
        height=200 + 40 * max(1, len(rows)), template="plotly_white")
    return figure


def render_html(report: LedgerReport) -> str:
    """The whole page (see the module docstring).

    Raises:
        ImportError: plotly is not installed.
    """
    plot = timeline_figure(report).to_html(full_html=False, include_plotlyjs=True, div_id="timeline")
    summary = "\n".join(f"<li>{html.escape(line)}</li>" for line in report_lines(report))
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>opd_store report</title></head>\n"
            f"<body><h1>opd_store report</h1>\n<ul id=\"summary\">\n{summary}\n</ul>\n{plot}\n</body></html>\n")


__all__ = ["render_html", "timeline_figure"]

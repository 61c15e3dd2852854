"""The goodput ledger: a run journal in the store (:mod:`._journal`, events :mod:`._events`), the
report built from it (:mod:`._report`, costs :mod:`._prices`, HTML timeline :mod:`._timeline`),
save planning (:mod:`._planning`) and Prometheus metrics (:mod:`._metrics`).

Nothing here is needed to save or resume. The user's guide, with how a trainer integration
journals (``Journal(store, world_size=...).record("start", ...)``): docs/ledger.md. The HTML
timeline and the metrics import their libraries on first use (``html``, ``prometheus`` extras).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ._events import (
    KINDS,
    MAX_EVENT_BYTES,
    SCHEMA_VERSION,
    ExitEvent,
    FirstUpdateEvent,
    NoticeEvent,
    ProgressEvent,
    ResumeEvent,
    SaveEvent,
    StartEvent,
    encode_event,
    parse_event,
)
from ._journal import (
    DEFAULT_KEEP_EVENTS,
    EventName,
    Journal,
    JournalContents,
    StartSummary,
    event_rel,
    list_journal,
    parse_event_name,
    previous_start,
    process_started_secs,
    prune_journal,
    read_journal,
)
from ._planning import (
    MAX_AUTO_EVERY,
    SAFETY_FACTOR,
    SAFETY_SECS,
    AutoInterval,
    FinalSavePlan,
    SaveEstimator,
    plan_final_save,
    young_daly_secs,
)
from ._prices import BUILT_IN, PriceTable, load_price_file, table_for_url
from ._report import ASSUMPTIONS, Commit, LedgerReport, build_report, report_json, report_lines, report_store

if TYPE_CHECKING:
    from ._metrics import PrometheusExporter
    from ._timeline import render_html, timeline_figure

__getattr__ = lazy_exports(__name__, {"PrometheusExporter": "._metrics", "render_html": "._timeline",
                                      "timeline_figure": "._timeline"})

__all__ = [
    "ASSUMPTIONS", "BUILT_IN", "DEFAULT_KEEP_EVENTS", "KINDS", "MAX_AUTO_EVERY", "MAX_EVENT_BYTES", "SAFETY_FACTOR",
    "SAFETY_SECS", "SCHEMA_VERSION", "AutoInterval", "Commit", "EventName", "ExitEvent", "FinalSavePlan",
    "FirstUpdateEvent", "Journal", "JournalContents", "LedgerReport", "NoticeEvent", "PriceTable", "ProgressEvent",
    "PrometheusExporter", "ResumeEvent", "SaveEstimator", "SaveEvent", "StartEvent", "StartSummary", "build_report",
    "encode_event", "event_rel", "list_journal", "load_price_file", "parse_event", "parse_event_name",
    "plan_final_save", "previous_start", "process_started_secs", "prune_journal", "read_journal", "render_html",
    "report_json", "report_lines", "report_store", "table_for_url", "timeline_figure", "young_daly_secs",
]

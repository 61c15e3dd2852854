"""``opd-store report --html``: one self-contained page, opened in a real headless Chromium (Debian's
``chromium``, which scripts/setup.sh installs) with every network request refused, renders one
marker per timeline item and one segment per preemption's lost work."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

from ledger_events import EVENTS

from opd_store import CheckpointStore
from opd_store.cli import main
from opd_store.ledger import encode_event, event_rel


def _journaled_store(path) -> CheckpointStore:
    store = CheckpointStore(path)
    for event in EVENTS:
        rel = event_rel(event.time_secs, event.start_id, event.seq, event.kind, getattr(event, "step", None))
        store.storage.create_exclusive(rel, encode_event(event))
    return store


def test_the_html_timeline_renders_in_chromium_with_one_mark_per_event(tmp_path, capsys):
    chromium = shutil.which("chromium")
    assert chromium is not None, "Debian's chromium is missing: bash scripts/setup.sh installs it"
    store = _journaled_store(tmp_path / "store")
    page = tmp_path / "report.html"
    assert main(["report", store.url, "--html", str(page), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    html = page.read_text()
    # Self-contained: no script, style sheet or frame fetched from anywhere.
    assert not re.search(r"<(script|link|iframe|img)[^>]+(src|href)=", html)
    assert len(report["timeline"]) == 11 and len(report["lost_work"]) == 2
    profile = tmp_path / "chromium-profile"
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         f"--user-data-dir={profile}", "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
         "--virtual-time-budget=15000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    dom = done.stdout
    assert len(re.findall(r'<path class="point"', dom)) == len(report["timeline"])
    assert len(re.findall(r'<g class="lines"><path class="js-line"', dom)) == len(report["lost_work"])
    legend = re.findall(r'<text class="legendtext"[^>]*>([^<]+)</text>', dom)
    assert legend == ["start", "save", "notice", "kill", "exit", "lost work"]
    assert "preemption of start 0 (killed): reached step 4, next start resumed from 2: 2 updates" in dom

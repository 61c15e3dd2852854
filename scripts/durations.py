"""Run the whole test suite and write its ``--durations`` report to tests/DURATIONS.md.

    bash scripts/setup.sh && .venv/bin/python scripts/durations.py [PYTEST ARGS...]

Runs ``.venv/bin/python -m pytest --durations=0 --durations-min=1.0`` (the README's test command,
xdist included, plus a JUnit XML for per-file totals), prints pytest's output as it comes, and
writes the report: the command, the machine (cores, load average before and after), the wall time,
the CPU seconds of the run and all its processes (``getrusage(RUSAGE_CHILDREN)``: every process
the run waited for, test workers, servers and children included), the outcome line, seconds per
test file (summed over its tests: setup, call and teardown), and pytest's slowest-durations table.
Exits with pytest's status (the report is written either way).
"""

from __future__ import annotations

import collections
import datetime as dt
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "tests" / "DURATIONS.md"
MIN_SECS = 1.0


def _per_file(junit: Path) -> list[tuple[str, float, int]]:
    """``(file, seconds, tests)`` from a JUnit XML, slowest first."""
    seconds: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        parts = case.get("classname", "").split(".")
        if not case.get("file"):  # classname is tests.dir.module[.Class]
            while parts and parts[-1][:1].isupper():
                parts.pop()
            name = "/".join(parts) + ".py"
        seconds[name] += float(case.get("time") or 0)
        counts[name] += 1
    return sorted(((name, secs, counts[name]) for name, secs in seconds.items()), key=lambda row: -row[1])


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="opd-durations-") as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [str(REPO / ".venv" / "bin" / "python"), "-m", "pytest", "--durations=0",
                   f"--durations-min={MIN_SECS}", f"--junitxml={junit}", *argv]
        load_before = os.getloadavg()
        started = time.monotonic()
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in process.stdout:
            sys.stdout.write(line)
            lines.append(line.rstrip("\n"))
        status = process.wait()
        wall = time.monotonic() - started
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        load_after = os.getloadavg()
        files = _per_file(junit) if junit.exists() else []
    outcome = next((line.strip("= ") for line in reversed(lines) if " in " in line and ("passed" in line or "failed" in line)), "?")
    table_start = next((i for i, line in enumerate(lines) if "slowest durations" in line), None)
    table = []
    if table_start is not None:
        for line in lines[table_start + 1:]:
            if line.startswith("=") or not line.strip():
                if table:
                    break
                continue
            table.append(line)
    out = [
        "# Test suite durations",
        "",
        "Regenerate with `bash scripts/setup.sh && .venv/bin/python scripts/durations.py` (a full run of the",
        "README's test command; see docs/testing.md). Times are wall-clock seconds on the machine below.",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{' '.join(['.venv/bin/python', *command[1:-1 - len(argv)], *argv])}`",
        f"- machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}; "
        f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
        f"after {' '.join(f'{x:.2f}' for x in load_after)}",
        f"- outcome: {outcome}",
        f"- wall time: {wall:.0f} s ({int(wall // 60)} min {wall % 60:.0f} s)",
        f"- CPU time of the run and every process it waited for: {usage.ru_utime + usage.ru_stime:.0f} s "
        f"(user {usage.ru_utime:.0f} s, system {usage.ru_stime:.0f} s)",
        "",
        "## Seconds per test file",
        "",
        "Setup, call and teardown of every test of the file, summed (under pytest-xdist the files' tests run",
        "on several workers at once, so the sum exceeds the wall time).",
        "",
        "| file | tests | seconds |",
        "|---|---:|---:|",
        *(f"| {name} | {count} | {secs:.1f} |" for name, secs, count in files),
        "",
        f"## Slowest phases (pytest `--durations`, >= {MIN_SECS:g} s)",
        "",
        "```",
        *table,
        "```",
        "",
    ]
    REPORT.write_text("\n".join(out), encoding="utf-8")
    print(f"wrote {REPORT.relative_to(REPO)}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

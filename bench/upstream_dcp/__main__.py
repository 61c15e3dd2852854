"""``python -m bench.upstream_dcp``: PyTorch's DCP test files against opd_store (see the package docstring).

    python -m bench.upstream_dcp --pytorch-tests ~/pytorch/test/distributed/checkpoint
    python -m bench.upstream_dcp --pytorch-tests DIR --mode memory --files test_file_system_checkpoint_cpu.py
    python -m bench.upstream_dcp --pytorch-tests DIR --cpu-gated      # also the GPU-gated cases, on CPU
    python -m bench.upstream_dcp --pytorch-tests DIR -- -k reshard -x # anything after -- goes to pytest

Prints, per file, the counts pytest reports and every case that did not pass with its first line;
``--junit DIR`` keeps pytest's JUnit XML there. Exit status: pytest's for the last file that
failed, else 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.upstream_dcp.substitute import MODES

FILES = (
    "test_file_system_checkpoint_cpu.py",
    "test_dtensor_resharding.py",
    "e2e/test_e2e_save_and_load.py",
    "test_nested_dict.py",
    "test_save_load_api.py",
)
"""The files of ``test/distributed/checkpoint/`` this command runs by default."""

ROOT = Path(__file__).resolve().parents[2]


def _outcomes(junit: Path) -> list[tuple[str, str, str]]:
    """``(case, outcome, first line)`` of every case in a JUnit XML report."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (found.get("message") or found.text or "").strip().splitlines()[0:1]
                detail = detail[0][:200] if detail else ""
                break
        rows.append((name, outcome, detail))
    return rows


def run_file(tests: Path, name: str, *, mode: str, cpu_gated: bool, junit_dir: Path, extra: list[str],
             timeout_secs: int) -> tuple[int, list[tuple[str, str, str]]]:
    """Run one PyTorch test file under the substitution; its exit code and case outcomes."""
    junit = junit_dir / (name.replace("/", "__") + ".xml")
    env = dict(os.environ, OPD_UPSTREAM_DCP=mode,
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench" / "upstream_dcp" / "site"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    if cpu_gated:
        env["OPD_UPSTREAM_DCP_CPU_GATED"] = "1"
    command = [sys.executable, "-m", "pytest", str(tests / name), "-p", "no:cacheprovider", "-q", "-n", "0",
               f"--junitxml={junit}", "--rootdir", str(tests), "-o", "addopts=", "--timeout", str(timeout_secs),
               *extra]
    done = subprocess.run(command, env=env, cwd=tests, check=False)
    return done.returncode, (_outcomes(junit) if junit.exists() else [])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m bench.upstream_dcp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pytorch-tests", type=Path, required=True,
                        help="PyTorch's test/distributed/checkpoint directory (a checkout of its sources)")
    parser.add_argument("--files", default=",".join(FILES), help="comma-separated files under it")
    parser.add_argument("--mode", choices=MODES, default="local", help="where the stores live (substitute.py)")
    parser.add_argument("--cpu-gated", action="store_true", help="run GPU-gated cases on CPU where they can")
    parser.add_argument("--junit", type=Path, help="keep pytest's JUnit XML reports in this directory")
    parser.add_argument("--timeout-secs", type=int, default=600, help="per case (pytest-timeout)")
    args = parser.parse_args(argv)
    junit_dir = args.junit or Path(tempfile.mkdtemp(prefix="upstream-dcp-"))
    junit_dir.mkdir(parents=True, exist_ok=True)
    status, totals = 0, {}
    for name in [f for f in args.files.split(",") if f]:
        code, rows = run_file(args.pytorch_tests, name, mode=args.mode, cpu_gated=args.cpu_gated,
                              junit_dir=junit_dir, extra=extra, timeout_secs=args.timeout_secs)
        counts = {outcome: sum(1 for _, o, _ in rows if o == outcome) for outcome in ("passed", "failed", "error", "skipped")}
        print(f"\n== {name} (mode {args.mode}{', cpu-gated' if args.cpu_gated else ''}): "
              + ", ".join(f"{n} {o}" for o, n in counts.items() if n) + f" (pytest exit {code})")
        for case, outcome, detail in rows:
            if outcome != "passed":
                print(f"   {outcome:7} {case}: {detail}")
        for outcome, n in counts.items():
            totals[outcome] = totals.get(outcome, 0) + n
        if code not in (0, 5):
            status = code
    print("\n== all files: " + ", ".join(f"{n} {o}" for o, n in totals.items() if n))
    return status


if __name__ == "__main__":
    sys.exit(main())

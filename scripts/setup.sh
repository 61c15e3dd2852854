#!/usr/bin/env bash
# Create .venv and install opd_store with everything the job, the demo and the tests need.
# torch is pinned here (pyproject keeps the range torch>=2.4): a CPU wheel of 2.13.0 is on every
# machine of this project, and any other spec would download several GB.
# Later runs only check: the install is redone when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.opd-store-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt testkit/pyproject.toml ] \
    && [ "$stamp" -nt scripts/setup.sh ]; then
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
# opd_store with the job, the demo's S3 emulator and the test tools; opd_testkit (testkit/: the
# servers, proxies and fork server of the tests and benchmarks, never in opd_store's wheel).
.venv/bin/python -m pip install --quiet -e ".[job,emulator,test]" -e ./testkit
# tests/ledger opens the report's HTML page in a real headless browser: Debian's chromium (a
# browser that a tool downloads on its own cannot be fetched on these machines).
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "setup.sh: install Debian's chromium (apt-get install chromium) for tests/ledger" >&2
        exit 1
    fi
fi
touch "$stamp"

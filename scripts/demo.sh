#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run `opd-store demo` (extra arguments are passed on, e.g. --s3-emulator).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bash "$here/scripts/setup.sh"
exec "$here/.venv/bin/opd-store" demo "$@"

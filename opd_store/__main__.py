"""``python -m opd_store`` runs the ``opd-store`` command line."""

import sys

from .cli import main

sys.exit(main())

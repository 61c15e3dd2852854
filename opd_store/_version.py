"""The package version (one place; ``opd_store.__version__`` and the job's provenance read it)."""

__version__ = "0.1.0"

"""Testing support for users of opd_store: a fault-injecting, recording wrapper around any
:class:`~opd_store.storage.Storage` (:class:`FaultyStorage`)."""

from ._faults import MUTATING, Fault, FaultyStorage, InjectedFault, Op

__all__ = ["MUTATING", "Fault", "FaultyStorage", "InjectedFault", "Op"]

"""The CRC32C cost of a save: a section of ``python -m bench`` (:func:`run_crc`).

CRC32C alone over the state's tensors (memoryviews of their storage, no copies) with awscrt (what
opd_store uses) and through ``opd_store.format._checksum.Crc32c``, against the store's save medians of the
same run. The ``crc32c`` package (opd_store's checksum before 2026-11-30, now the tests' independent
oracle) is timed beside it when installed (the ``bench`` extra), and torch's own zip CRC-32 for
scale. Target: < 5 % of the save.
"""

from __future__ import annotations

import os

from bench._common import MIB, _version, median, tensor_views, timed

CRC_TARGET_PCT = 5.0


def _crc32c_package_available() -> bool:
    try:
        import crc32c  # noqa: F401
    except ImportError:
        return False
    return True


class _SpyWriter:
    def __init__(self) -> None:
        self.calls = 0
        self.memoryviews = 0
        self.contiguous = 0
        self.other_types: set[str] = set()
        self.nbytes = 0

    def write(self, data) -> int:
        self.calls += 1
        if isinstance(data, memoryview):
            self.memoryviews += 1
            self.contiguous += int(data.c_contiguous)
        else:
            self.other_types.add(type(data).__name__)
        n = memoryview(data).nbytes
        self.nbytes += n
        return n

    def flush(self) -> None:
        pass


def run_crc(args, state, speed_results: dict) -> list[str]:
    import torch
    from awscrt import checksums

    from opd_store.format import Crc32c

    views = tensor_views(state)
    nbytes = sum(v.nbytes for v in views)

    def raw_crc() -> int:
        value = 0
        for view in views:
            value = checksums.crc32c(view, value)
        return value

    def store_crc() -> str:
        hasher = Crc32c()
        for view in views:
            hasher.update(view)
        return hasher.hexdigest()

    def package_crc() -> int:
        import crc32c

        fn = crc32c.crc32c
        value = 0
        for view in views:
            value = fn(view, value)
        return value

    raw_crc()
    raw_times = [timed(raw_crc)[0] for _ in range(max(3, args.repeats))]
    store_times = [timed(store_crc)[0] for _ in range(max(3, args.repeats))]
    crc_secs = median(raw_times)
    wrapper_secs = median(store_times)
    package_secs = None
    if _crc32c_package_available():
        if package_crc() != raw_crc():
            raise RuntimeError("the crc32c package and awscrt disagree")
        package_secs = median([timed(package_crc)[0] for _ in range(max(3, args.repeats))])

    spy = _SpyWriter()
    torch.save(state, spy)

    # torch.save's own zip CRC-32 per record (torch >= 2.5 can turn it off), for scale.
    zip_crc = None
    try:
        from torch.utils.serialization import config as ser_config
    except ImportError:
        ser_config = None
    if ser_config is not None and hasattr(ser_config.save, "compute_crc32"):
        previous = ser_config.save.compute_crc32

        def save_to_null() -> None:
            with open(os.devnull, "wb") as handle:
                torch.save(state, handle)

        try:
            timings = {}
            for flag in (True, False):
                ser_config.save.compute_crc32 = flag
                timings[flag] = median([timed(save_to_null)[0] for _ in range(3)])
        finally:
            ser_config.save.compute_crc32 = previous
        zip_crc = timings

    lines = [
        f"Implementation: awscrt {_version('awscrt')} `checksums.crc32c` (AWS Common Runtime; hardware "
        "SSE4.2/PCLMULQDQ or ARMv8 CRC instructions, GIL released); it takes any buffer-protocol object, "
        "so memoryviews of tensor storage are checksummed in place.",
        f"torch.save handed the writer {spy.calls} write calls: {spy.memoryviews} memoryviews "
        f"({spy.contiguous} C-contiguous, so `Crc32c.update` never copies)"
        + (f", other types {sorted(spy.other_types)}" if spy.other_types else ", no other types")
        + f"; {spy.nbytes / MIB:.1f} MiB in all.",
        "",
        "| measurement | seconds | GiB/s |",
        "|---|---|---|",
        f"| awscrt checksums.crc32c over {len(views)} tensor memoryviews ({nbytes / MIB:.0f} MiB) | {crc_secs:.3f} | {nbytes / 2**30 / crc_secs:.1f} |",
        f"| opd_store.format._checksum.Crc32c.update over the same | {wrapper_secs:.3f} | {nbytes / 2**30 / wrapper_secs:.1f} |",
    ]
    if package_secs is not None:
        lines.append(
            f"| (alternative) `crc32c` package {_version('crc32c')} over the same | "
            f"{package_secs:.3f} | {nbytes / 2**30 / package_secs:.1f} |"
        )
    if zip_crc is not None:
        lines.append(
            f"| (for scale) torch.save to /dev/null, zip CRC-32 on (default) / off "
            f"(`torch.utils.serialization.config.save.compute_crc32`) | {zip_crc[True]:.3f} / {zip_crc[False]:.3f} | "
            f"torch's own CRC-32: ~{nbytes / 2**30 / max(zip_crc[True] - zip_crc[False], 1e-9):.1f} |"
        )
    lines += [
        "",
        "| backend | store save median (s) | crc share of save (Crc32c.update) | target | share with the crc32c package (info) |",
        "|---|---|---|---|---|",
    ]
    for name, result in speed_results.items():
        if name.startswith("_"):
            continue
        save = median([m["wall"] for m in result["runs"]["store_save"]])
        pct = 100 * wrapper_secs / save
        alternative = f"{100 * package_secs / save:.1f} %" if package_secs is not None else "-"
        lines.append(
            f"| {name} | {save:.2f} | {pct:.1f} % | {'PASS' if pct < CRC_TARGET_PCT else 'MISS'} "
            f"(< {CRC_TARGET_PCT:.0f} %) | {alternative} |"
        )
    if not speed_results:
        lines.append("| (speed section not run) | | | | |")
    lines.append("")
    lines.append(
        "The same CRC pass also runs on every verified read (`store.read`/`store.open` checksum the "
        "whole payload), where its share of a warm local load is far larger than of a save."
    )
    return lines


__all__ = ["CRC_TARGET_PCT", "run_crc"]

"""Engine processes a benchmark did not start, which would share its cores.

An engine core whose client ended without shutting it down (a script's
``os._exit``) spins on a core for good: 17 of them, left by diagnostics,
took the 2-core AMD host's load average to 78, and every timing taken
beside them was wrong (CHANGELOG, 2026-12-07). Benchmarks warn at every
engine start and count them in each run's provenance.
"""

import os
from pathlib import Path


def stray_engines() -> list[int]:
    """Running vLLM engine processes (``VLLM::`` titles) that neither this
    process nor its descendants are: zombies aside, another run's."""
    parents, engines = {}, []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while read, or not ours to read
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        if comm.startswith("VLLM::") and fields[0] not in ("Z", "X"):
            engines.append(pid)

    def ours(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            if pid == os.getpid():
                return True
            seen.add(pid)
            pid = parents.get(pid, 0)
        return False

    return sorted(pid for pid in engines if not ours(pid))


def warn_stray_engines() -> list[int]:
    """Warn (vLLM's logger) when stray engine processes would share the cores with this run's."""
    stray = stray_engines()
    if stray:
        from vllm_dspark.log import get_logger

        get_logger(__name__).warning(
            "%d vLLM engine processes this run did not start are running (pids %s): they take CPU from "
            "every timing here. Stop them (kill %s) and start again.", len(stray),
            " ".join(map(str, stray[:8])), " ".join(map(str, stray)))
    return stray

"""The CPUs a command may use: every `--threads` option's default."""
from __future__ import annotations

import os


def default_threads() -> int:
    """The CPUs this process may run on (its affinity mask, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_or_all(threads: int) -> int:
    """`--threads N`: N, or every CPU this process may run on for 0."""
    return threads if threads > 0 else default_threads()

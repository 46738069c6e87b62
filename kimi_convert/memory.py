"""The process's memory, as the commands report it."""
from __future__ import annotations

import resource


def peak_rss() -> int:
    """The peak resident set of this process so far, in bytes (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

"""Garbage-collector control shared by the readers (checkpoint index, GGUF headers, conversion plans)."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hundreds of thousands of long-lived records trigger repeated full collections that find
    nothing to free (a third of the load time of the real model's index); pause them meanwhile."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

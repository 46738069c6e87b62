"""interrupts.deferred: SIGINT, SIGTERM and SIGHUP wait for the end of a commit and its cleanup, then end the
command as they would have (errors.Interrupted from cli.interrupts_raise's handler), in the block's own frame."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import pytest

from kimi_convert.cli.common import interrupts_raise
from kimi_convert.errors import Interrupted
from kimi_convert import interrupts
from kimi_convert.interrupts import deferred


def busy(seconds: float = 0.05) -> None:
    """Bytecodes to run: a handler that is not held would raise in here."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def held(sig: int) -> None:
    """Run bytecodes until `sig` is held, by the kernel or by the handler: the thread the kernel gave it to
    may run its C handler only later (two busy cores)."""
    end = time.monotonic() + 10
    while sig not in signal.sigpending() and sig not in interrupts._Window.postponed:
        assert time.monotonic() < end, "the signal never arrived"
        signal.pthread_sigmask(signal.SIG_BLOCK, [])        # runs a handler whose flag another thread tripped
    busy()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_sent_inside_the_block_is_delivered_at_its_end(sig):
    done = []
    with interrupts_raise(), pytest.raises(Interrupted) as e:
        with deferred():
            os.kill(os.getpid(), sig)
            held(sig)
            done.append("the block ran to its end")
    assert done and e.value.signum == sig
    frames = [f.name for f in traceback.extract_tb(e.value.__traceback__)]
    assert "_deliver" in frames and "busy" not in frames, frames     # raised at the block's end, in its frame


def test_a_signal_another_thread_takes_is_postponed_too():
    # the kernel hands a process signal to a thread that does not block it; the handler still runs in the main
    # thread, blocked there or not: the handler itself must ask whether a deferred block is open
    ready, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (ready.set(), stop.wait(10)))
    worker.start()
    ready.wait()
    done = []
    try:
        with interrupts_raise(), pytest.raises(Interrupted):
            with deferred():
                signal.pthread_kill(worker.ident, signal.SIGTERM)
                held(signal.SIGTERM)
                assert interrupts._Window.postponed == [signal.SIGTERM]     # the handler ran, and held it
                done.append("the block ran to its end")
    finally:
        stop.set()
        worker.join()
    assert done


def test_nested_blocks_are_one_block():
    done = []
    with interrupts_raise(), pytest.raises(Interrupted):
        with deferred():
            with deferred():
                busy(0.01)
            os.kill(os.getpid(), signal.SIGTERM)        # after the inner block: still held by the outer one
            held(signal.SIGTERM)
            done.append("the outer block ran to its end")
    assert done


def test_a_block_without_a_signal_delivers_nothing():
    with interrupts_raise():
        with deferred():
            busy(0.01)
    assert not signal.sigpending()


class _Finalized:
    """An object whose __del__ runs Python code while a signal is pending (as a thread's does, through
    threading's WeakSet, when it is freed at the end of a write)."""
    ran = False

    def __del__(self):
        signal.raise_signal(signal.SIGTERM)     # to this thread: the handler runs at the next check, in here
        busy(0.02)
        _Finalized.ran = True


def test_a_signal_that_lands_in_a_finalizer_is_not_dropped(monkeypatch):
    # found by scripts/campaign.py (seed 5 run 4315, seed 6 run 233): the handler ran inside WeakSet._remove,
    # whose exception the interpreter prints as "Exception ignored" and drops; the run then ended 0
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    with pytest.raises(Interrupted) as e:
        with interrupts_raise():
            _Finalized()                        # freed at once: __del__ runs here, and the handler in it
            busy()
            assert interrupts._Window.postponed == [signal.SIGTERM]
            interrupts.deliver_postponed()      # where the writer would stop: its next tensor
    assert _Finalized.ran and e.value.signum == signal.SIGTERM and dropped == []

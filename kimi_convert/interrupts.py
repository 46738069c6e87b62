"""SIGINT, SIGTERM and SIGHUP, the signals that stop a command, and the windows in which they wait.

A commit (finished files renamed into place) and the cleanup around it must run to their end: a signal
that landed in the middle would leave a partial folder or a lock file behind. Inside `deferred()` the
three signals wait, and are delivered when the block ends. Two mechanisms, because either alone leaks:
the calling thread blocks them (pthread_sigmask), which holds a signal whose action is the kernel's own;
and a Python-level handler (cli.interrupts_raise) asks `postpone` first, because a signal that the kernel
hands to another thread (a worker pool's) still runs the handler in the main thread, blocked or not. At the
block's end the held signals are acted on in its own frame, not wherever the interpreter would next look.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Window:
    open = False                # inside a deferred() block of the main thread
    postponed: list[int] = []   # signals its handler was asked to take meanwhile, in order


def in_finalizer(frame) -> bool:
    """Whether `frame` runs inside a __del__ or a weakref callback (threading's WeakSet of threads, for one):
    the interpreter prints and drops an exception raised there, so a handler must not raise in it."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name in ("_remove", "__call__")
                                         and code.co_filename.endswith(("_weakrefset.py", "weakref.py"))):
            return True
        frame = frame.f_back
    return False


def postpone(signum: int, frame=None) -> bool:
    """For a signal handler: inside a deferred() block, or inside a finalizer (`frame`, see in_finalizer), keep
    `signum` and say True. A block delivers what it kept at its end; deliver_postponed what a finalizer kept."""
    if not (_Window.open or in_finalizer(frame)):
        return False
    if signum not in _Window.postponed:
        _Window.postponed.append(signum)
    return True


def deliver_postponed() -> None:
    """Outside a deferred() block, act here on the signals kept meanwhile (by a finalizer's frame). Called
    where a command can stop cleanly: each tensor the writer starts, each deferred() block it enters, and the
    end of cli.interrupts_raise."""
    if _Window.open or not _Window.postponed:
        return
    postponed, _Window.postponed = _Window.postponed, []
    for signum in postponed:
        _deliver(signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends, then deliver them (the handler then raises, or
    the default action ends the process). Nested blocks are part of the outermost one."""
    if _Window.open:
        yield
        return
    deliver_postponed()
    main = threading.current_thread() is threading.main_thread()     # Python runs handlers there only
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    _Window.open = main
    try:
        yield
    finally:
        if main:
            # a signal another thread took has only tripped a flag, which the main thread may not have looked
            # at yet (CPython 3.11 sets its eval breaker only from the main thread): pthread_sigmask runs the
            # handlers now, while the window is open
            signal.pthread_sigmask(signal.SIG_BLOCK, [])
            for signum in sorted(signal.sigpending() & set(INTERRUPTS)):   # held by the kernel: taken here
                signal.sigtimedwait([signum], 0)
                postpone(signum)
        _Window.open = False
        postponed, _Window.postponed = _Window.postponed, []
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        for signum in postponed:
            _deliver(signum)


def _deliver(signum: int) -> None:
    """Act on a held signal here, in this frame: a Python handler is called directly (left to the
    interpreter, it may run inside a weakref callback or a __del__, which swallow its exception)."""
    handler = signal.getsignal(signum)
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)     # the kernel's default action: the process ends by the signal

"""Reading the small files a command is given (config.json, the index, the tokenizer's config, a policy, an
imatrix): a regular file only, opened without blocking, read whole under a size limit, and JSON parsed into one
error that names the file, for a bad document, deep nesting or a 5000-digit number alike."""
from __future__ import annotations

import json
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import CheckpointError, KimiError

_NOT_REGULAR = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


@contextmanager
def open_input(path: Path, error: type[KimiError] = CheckpointError, missing: str = "not found"):
    """(fd, size) of `path`, a regular file or a symlink to one (the Hugging Face cache's
    snapshots/REV/x -> ../../blobs/SHA), opened read-only; anything else is `error` naming it.

    A FIFO or a device is refused by its stat before it is opened, and the open cannot block
    (O_NONBLOCK), should the file be swapped for one in between."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: is {_file_kind(mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        dangling = f" (a symlink to {os.readlink(path)}, which does not exist)" if os.path.islink(path) else ""
        raise error(f"{path}: {missing}{dangling}") from None
    except OSError as e:            # PermissionError, ELOOP, EIO, ...
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: is {_file_kind(st.st_mode)}, not a regular file")
        yield fd, st.st_size
    finally:
        os.close(fd)


def read_input(path: Path, limit: int, error: type[KimiError] = CheckpointError,
               missing: str = "not found") -> str:
    """The text (UTF-8) of a small input file, config.json or the index, through open_input."""
    with open_input(path, error, missing) as (fd, size):
        if size > limit:
            raise error(f"{path}: {size:,} bytes, more than the {limit:,} such a file can need")
        try:
            data = os.pread(fd, size, 0)      # one read: the kernel returns up to 2 GiB at once
        except OSError as e:
            raise error(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) != size:
        raise error(f"{path}: changed while being read ({len(data):,} of {size:,} bytes)")
    try:
        return data.decode("utf-8")     # the bytes are let go on return, before the text is parsed
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 (byte {e.start})") from None


def _file_kind(mode: int) -> str:
    return next((kind for test, kind in _NOT_REGULAR if test(mode)), "not a regular file")



def read_json(path: Path, limit: int, error: type[KimiError] = CheckpointError, *, missing: str = "not found",
              bad: str = "not valid JSON") -> Any:
    """`path` (at most `limit` bytes, through read_input) parsed as JSON; `error` "PATH: BAD (why)" if it is not
    JSON, is nested too deeply for the parser, or holds an integer of over 4300 digits."""
    text = read_input(path, limit, error, missing)
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{path}: {bad} (nested too deeply)") from None
    except ValueError as e:         # json.JSONDecodeError, an integer of over 4300 digits
        raise error(f"{path}: {bad} ({e})") from None

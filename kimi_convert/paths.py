"""Nothing lost: the one rule for the files a command reads and the paths it writes.

Every command lists each file it will read (`Input`: the checkpoint's config, index, shards and tokenizer files; a
GGUF and all its split parts; the policy, the tensor-type files, the imatrix, a manifest) and each path it will
write (`Output`: OUT and every part name, the manifest, the lock, the partial folder, the reports), and
`refuse_overlap` refuses the run, before it writes a byte, when a write would replace or change a file it reads, or
when two writes are one path. Paths are compared as the file system sees them, not as strings:

- a read is the file behind its path after symlinks (device, inode), and the directory entries that name it: the
  one given and the one its symlinks lead to;
- an output that is renamed into place (OUT, its parts, the manifest, a report: each written under another name,
  then renamed) replaces only the directory entry it names. It overlaps a read that is that entry. Renaming over
  a symlink or a hard link to an input replaces the link, and the input stays as it was;
- a path that is opened in place (the lock file, a report written to a FIFO) also changes the file behind it;
- a folder a command creates, fills or removes (the partial folder, a stale one, the slice's OUT_DIR) overlaps
  every read inside it.

`--force` lets an output replace an earlier output, never an input.

The helper files beside an output (its lock, its partial folder, its manifest, a report's temporary name) are
named from the output's name (`helper_stem`), shortened with a hash of it when the longest of them would pass
the file system's name limit, so that every output name the file system takes works.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .errors import OutputError

RENAMED, IN_PLACE, FOLDER = "renamed", "in place", "folder"
# the longest suffix a helper adds to the output's name: "." before, ".partial-" and a pid (at most 7 digits on
# Linux, 10 reserved) after
HELPER_ROOM = 1 + len(".partial-") + 10
NAME_MAX = 255          # when the file system does not say (pathconf)


class OverlapError(OutputError):
    """A path the command would write is a file it reads, or another path it writes."""


@dataclass(frozen=True)
class Input:
    path: Path
    what: str                   # "checkpoint shard", "input GGUF", "policy file", ...


@dataclass(frozen=True)
class Output:
    path: Path
    what: str                   # "output", "split part", "manifest", "lock file", "--json report", ...
    mode: str = RENAMED         # RENAMED, IN_PLACE or FOLDER


def refuse_overlap(inputs: Iterable[Input], outputs: Iterable[Output]) -> None:
    """Raise OverlapError (one line naming both paths) if an output would overwrite an input, or two outputs
    are one path. Paths that do not exist yet (or whose folder does not) cannot overlap and pass."""
    reads = [(i, _read_ids(i.path)) for i in inputs]
    written: list[tuple[Output, set]] = []
    for o in outputs:
        ids = _write_ids(o)
        for i, read_ids in reads:
            if ids & read_ids or (o.mode == FOLDER and _inside(i.path, o.path)):
                raise OverlapError(_overlap_message(o, i))
        for other, other_ids in written:
            if ids & other_ids:
                raise OverlapError(f"{o.path}: the {o.what} and the {other.what} ({other.path}) are the same "
                                   f"file; give them different names")
        written.append((o, ids))


def _overlap_message(o: Output, i: Input) -> str:
    named = "" if os.path.abspath(o.path) == os.path.abspath(i.path) else f" {i.path}"
    verb = "would write into the folder of" if o.mode == FOLDER else "would overwrite"
    return (f"{o.path}: the {o.what} {verb} the {i.what}{named}, which this run reads; "
            f"write it elsewhere (--force never overwrites an input)")


def _entry(path: Path) -> tuple | None:
    """The directory entry `path` names: its folder (device, inode, after symlinks) and its name."""
    path = Path(path)
    try:
        st = os.stat(path.parent)
    except OSError:
        return None
    return ("entry", st.st_dev, st.st_ino, path.name)


def _file(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return None
    return ("file", st.st_dev, st.st_ino)


def _read_ids(path: Path) -> set:
    return {x for x in (_entry(path), _entry(Path(os.path.realpath(path))), _file(path)) if x is not None}


def _write_ids(o: Output) -> set:
    ids = {_entry(o.path)}
    if o.mode == IN_PLACE:
        ids |= {_entry(Path(os.path.realpath(o.path))), _file(o.path)}
    return {x for x in ids if x is not None}


def _inside(path: Path, folder: Path) -> bool:
    """`path` (after symlinks) is inside `folder` (after symlinks), compared by the folders' identities."""
    try:
        target = os.stat(folder)
    except OSError:
        return False
    p = Path(os.path.realpath(path)).parent
    while True:
        try:
            st = os.stat(p)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            return True
        if p.parent == p:
            return False
        p = p.parent


# --- helper names ---------------------------------------------------------------------------------

def name_limit(folder: Path) -> int:
    """The longest file name (bytes) the file system of `folder` takes."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX


def helper_stem(out: Path) -> str:
    """The name the helpers of `out` are made from: its own, or, where a helper's name would pass the file
    system's limit, as much of it as fits (whole UTF-8 characters) with '~' and 16 hex digits of its SHA-256."""
    name = Path(out).name
    raw, limit = os.fsencode(name), name_limit(Path(out).parent)
    if len(raw) + HELPER_ROOM <= limit:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    room = max(0, limit - HELPER_ROOM - 1 - len(digest))
    return os.fsdecode(raw[:room]).encode("utf-8", "ignore").decode("utf-8", "ignore") + "~" + digest


def check_name_fits(path: Path, what: str) -> None:
    """An output's own name (a split part's, say) must fit the file system; a helper's is made to (helper_stem)."""
    n, limit = len(os.fsencode(Path(path).name)), name_limit(Path(path).parent)
    if n > limit:
        raise OutputError(f"{path}: the {what}'s name is {n} bytes, more than the {limit} its file system takes; "
                          f"give OUT a shorter name")


# --- reports ----------------------------------------------------------------------------------------

def report_output(path: Path, option: str = "--json") -> Output:
    """The Output a report to `path` is (refuse_overlap before Report(path) checks, or opens, it): renamed into
    place when it is, or will be, a regular file; written in place when it is a FIFO or a device."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        regular = True
    return Output(Path(path), f"{option} report", RENAMED if regular else IN_PLACE)


class Report:
    """A report a command writes (--json): committed with the command's output, or not at all.

    A regular file (new, or an earlier report with --force) is written under a temporary name and renamed into
    place, with the output's files when there are any (`stage`), so that a failure leaves neither. A FIFO or a
    terminal is opened now, without blocking, so that one with no reader fails before any work, and written
    last (`deliver`)."""

    def __init__(self, path: Path, force: bool, option: str = "--json"):
        self.path, self.option = Path(path), option
        self.fd: int | None = None
        folder = self.path.parent
        if self.path.is_dir():
            raise OutputError(f"{path}: is a folder; {option} takes a file name")
        if not folder.is_dir():
            raise OutputError(f"{path}: cannot write the report: the folder {folder} does not exist")
        try:
            mode = os.stat(self.path).st_mode
        except OSError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            self.fd = self._open_stream()
            return
        if not os.access(folder, os.W_OK | os.X_OK):
            raise OutputError(f"{path}: cannot write the report: permission denied")
        if mode is not None and not force:
            raise OutputError(f"{path}: already exists (use --force to overwrite)")
        check_name_fits(self.path, "report")

    @property
    def output(self) -> Output:
        return report_output(self.path, self.option)

    def _open_stream(self) -> int:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            why = "no process reads this FIFO" if e.errno == errno.ENXIO else e.strerror or str(e)
            raise OutputError(f"{self.path}: cannot write the report ({why})") from None
        os.set_blocking(fd, True)        # a reader may be slower than us: wait for it, do not fail
        return fd

    def stage(self, folder: Path, text: str) -> tuple[Path, Path] | None:
        """Write `text` into `folder` (the output's partial folder) for the commit to rename: (temporary, final).
        A stream is written now instead (None): the last step before the commit."""
        if self.fd is not None:
            self.deliver(text)
            return None
        tmp = Path(folder) / f".{helper_stem(self.path)}.report"
        self._write_file(tmp, text)
        return tmp, self.path

    def deliver(self, text: str) -> None:
        """Write the report on its own: into the stream, or under a temporary name beside it, then renamed."""
        if self.fd is None:
            tmp = self.path.parent / f".{helper_stem(self.path)}.partial-{os.getpid()}"
            try:
                self._write_file(tmp, text)
                os.replace(tmp, self.path)
            except OSError as e:
                raise OutputError(f"{self.path}: cannot write the report ({e.strerror or e})") from None
            finally:
                Path(tmp).unlink(missing_ok=True)
            return
        try:
            data = text.encode()
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:
            raise OutputError(f"{self.path}: cannot write the report ({e.strerror or e})") from None
        finally:
            self.close()

    def _write_file(self, tmp: Path, text: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

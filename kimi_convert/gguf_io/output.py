"""Where a GGUF writer writes: output and split paths, the partial folder and the stale ones of dead runs, the
lock that keeps a second run out, the free disk a write needs, and the files a finished run leaves."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..errors import DiskSpaceError, OutputError
from ..interrupts import deferred
from ..paths import FOLDER, IN_PLACE, Output, Report, check_name_fits, helper_stem
from . import manifest as mf


def split_paths(out: Path, n_files: int) -> list[Path]:
    """llama.cpp's split naming: OUT-00001-of-00003.gguf."""
    if n_files == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i + 1:05d}-of-{n_files:05d}.gguf") for i in range(n_files)]


def check_output_folder(out: Path) -> None:
    """The output's folder exists and is a folder."""
    folder = Path(out).parent
    if not folder.exists():
        raise OutputError(f"{folder}: no such folder (create it first)")
    if not folder.is_dir():
        raise OutputError(f"{folder}: not a folder")


def check_output_paths(finals: list[Path], force: bool) -> None:
    """The output's folder exists, no output is a folder, and none exists unless `force`."""
    check_output_folder(finals[0])
    for p in finals:
        if p.is_dir():
            raise OutputError(f"{p}: is a folder; give the output file's name, e.g. {p / 'model.gguf'}")
        if p.exists() and not force:
            raise OutputError(f"{p}: already exists (use --force to overwrite)")


def partial_dir(out: Path, pid: int | None = None) -> Path:
    """The hidden folder beside `out` in which process `pid` (default: this one) writes it."""
    return out.parent / f".{helper_stem(out)}.partial-{os.getpid() if pid is None else pid}"


def stale_partials(out: Path) -> list[Path]:
    """Partial folders of `out` whose process is gone: what SIGKILL or a crash leaves behind."""
    pattern = re.compile(rf"\.{re.escape(helper_stem(out))}\.partial-(\d+)")
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []
    return sorted(p for p in entries
                  if (m := pattern.fullmatch(p.name)) and p.is_dir() and not _process_alive(int(m[1])))


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():          # this run has not started writing: the folder is a dead namesake's
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # another user's live process
        return True
    return True


def disk_bytes(folder: Path) -> int:
    """Disk blocks used by the files under `folder` (a sparse file counts what it holds)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


HEADROOM = 64 << 20           # header, KV data (the vocabulary) and alignment padding, beyond the tensors
MIN_SPLIT_SIZE = 1_000_000    # 1M: the smallest size llama.cpp's gguf-split takes (it counts in M and G)


def check_split_max_size(n: int, spelled: str | None = None) -> None:
    """A split size under 1M is a slip (10 for 10G), not a wish for one file per tensor."""
    if n < MIN_SPLIT_SIZE:
        raise OutputError(f"--split-max-size {spelled or n}: must be at least 1M (1,000,000 bytes); "
                          f"K, M, G and T count in powers of 1000")


@dataclass
class DiskRoom:
    folder: Path
    free: int                 # free now, plus what the stale partial folders to be removed hold
    need: int                 # tensor bytes + HEADROOM

    @property
    def enough(self) -> bool:
        return self.free >= self.need


def disk_room(nbytes: int, out: Path, reclaimable: int = 0) -> DiskRoom:
    """Room for `nbytes` of tensors beside `out` (+ HEADROOM for the header), counting what stale
    partial folders that will be removed hold."""
    folder = Path(out).parent.absolute()
    return DiskRoom(folder, shutil.disk_usage(folder).free + reclaimable, nbytes + HEADROOM)


def check_free_disk(room: DiskRoom) -> None:
    if not room.enough:
        raise DiskSpaceError(f"{room.folder}: not enough free disk: {room.need / 2**30:.2f} GiB needed "
                             f"({room.need:,} bytes: the tensors + 64 MiB), {room.free / 2**30:.2f} GiB free "
                             f"({room.free:,} bytes)")


def remove_stale(stale: list[Path], log: Callable[[str], None]) -> None:
    """Remove the partial folders of dead processes (stale_partials), saying so."""
    for p in stale:
        try:
            shutil.rmtree(p)
        except OSError as e:
            raise OutputError(f"{p}: cannot remove this stale partial output ({e.strerror or e})") from None
        log(f"removed {p}: a partial output of process {p.name.rsplit('-', 1)[1]}, which is gone")


def lock_path(out: Path) -> Path:
    return Path(out).parent / f".{helper_stem(Path(out))}.lock"


NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)   # file systems without flock (some FUSE and NFS)


_HELD: dict[str, int] = {}      # lock files this process holds (their real paths) -> how many holders


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[Path]:
    """Hold `.OUT.lock` (flock) while `out` is planned and written, so that a second run into the same output
    refuses before any heavy work. The kernel drops a flock when its process ends, however it ends: a lock file
    left by SIGKILL blocks nothing. The file holds the holder's pid, for the second run's message; it is removed
    at the end. Re-entrant in one process: the command takes it first, the writer again."""
    path = lock_path(out)
    held = os.path.join(os.path.realpath(path.parent), path.name)
    if held in _HELD:
        _HELD[held] += 1
        try:
            yield path
        finally:
            _HELD[held] -= 1
        return
    check_output_folder(Path(out))
    with deferred():                # a signal between creating the file and owning it would leave it behind
        fd = _lock(Path(out), path)
        _HELD[held] = 1
    try:
        yield path
    finally:
        with deferred():
            del _HELD[held]
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)


def _lock(out: Path, path: Path) -> int:
    """Create (or open) and flock `path`, write our pid into it; the open fd."""
    while True:
        try:
            # O_NOFOLLOW: a lock file that is a symlink would truncate what it points at
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:        # a read-only folder, a symlink (ELOOP), say
            raise OutputError(f"{out}: cannot write in {path.parent} ({e.strerror or e}); nothing was written") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            who = f"process {holder}" if holder.isdigit() else "another process"
            raise OutputError(f"{out}: another run ({who}) is writing this output now ({path} is locked); "
                              f"wait for it to end, or stop it") from None
        except OSError as e:
            if e.errno not in NO_LOCKS:
                os.close(fd)
                raise
        if _same_file(path, fd):
            break
        os.close(fd)        # its holder removed it between our open and our lock: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return fd


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def written_paths(out: Path, finals: list[Path] | None = None, reports: Iterable[Report] = ()) -> list[Output]:
    """Every path a write of `out` (as `finals`: its file or split parts) writes, creates or removes, for
    paths.refuse_overlap; each file's name checked against the file system's limit."""
    finals = finals or [out]
    what = "split part" if len(finals) > 1 else "output"
    for p in finals:
        check_name_fits(p, what)
    return [*(Output(p, what) for p in finals), Output(mf.manifest_path(out), "manifest"),
            Output(lock_path(out), "lock file", IN_PLACE), Output(partial_dir(out), "partial folder", FOLDER),
            *(Output(p, "stale partial folder", FOLDER) for p in stale_partials(out)),
            *(r.output for r in reports)]

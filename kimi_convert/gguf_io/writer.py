"""Writing GGUF files: the one streaming writer, shared by the converter and the quantizer.

Metadata and tensor infos go through gguf's own GGUFWriter (so the header,
KV encoding and split naming are llama.cpp's); tensor data is then streamed chunk by
chunk, so no tensor (a 4.9 GB stacked expert tensor, say) is ever held whole. Files
are written into a hidden partial folder beside the output (`.OUT.partial-PID`) and
renamed into place only when every byte is down: an error, or a signal that raises
(see errors.Interrupted), leaves nothing behind. A partial folder whose process is gone
(SIGKILL, a crash) is removed by the next run into the same output, or taken over by one
with `resume`: the parts its journal lists as finished are kept (manifest.py). Each tensor is
hashed as it streams past, and OUT.gguf.manifest.json is renamed into place after the
file(s) it describes. A lock file (`.OUT.lock`, flock) keeps a second run out while one writes.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import mmap
import os
import queue
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Union

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as QT
from gguf.gguf_writer import WriterState

from ..errors import CheckpointError, DiskSpaceError, OutputError
from ..interrupts import deferred, deliver_postponed
from ..paths import FOLDER, IN_PLACE, Input, Output, Report, check_name_fits, helper_stem, refuse_overlap
from . import manifest as mf
from .qtypes import QUANT_SIZES

COPY_CHUNK = 64 << 20


def tensor_nbytes(qtype: QT, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of numpy-order `shape` stored as `qtype`."""
    block, size = QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block ({block})")
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


@dataclass(frozen=True)
class FileRange:
    """Bytes to copy verbatim from a source file (kernel-side where possible)."""
    path: Path
    offset: int
    length: int


Chunk = Union[bytes, bytearray, memoryview, np.ndarray, FileRange]


@dataclass
class OutTensor:
    name: str
    qtype: QT
    shape: tuple[int, ...]            # numpy order: the reverse of ggml's ne
    chunks: Callable[[], Iterable[Chunk]]
    part: int | None = None           # split file this tensor must go to (None: the writer's limits decide)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


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


def _split_setting(max_size: int, max_tensors: int) -> str:
    limits = [f"{max_size:,} bytes"] * bool(max_size) + [f"{max_tensors} tensors"] * bool(max_tensors)
    return " and ".join(limits) or "none"


class GGUFStreamWriter:
    """Collects metadata, then writes a (possibly split) GGUF from streamed tensors, and its manifest.

    Every OSError of the writing ends as one OutputError naming the output (DiskSpaceError for
    a full disk or quota), after the partial folder is removed.

    `tool` names the command in the manifest. `inputs` (the files the bytes come from) and `settings`
    (option -> value, for the options that shape the bytes) make, with the split limits and the headers,
    the run's plan: `resume` takes over an interrupted run's partial folder only if its plan is the same.
    `manifest=False` hashes nothing and writes no manifest (measuring what hashing costs).
    `reads` are the other files the run reads (a policy, an imatrix, ...): no path it writes may be one of them, nor
    one of `inputs` (paths.refuse_overlap). `reports` are renamed into place with the file(s) (paths.Report).
    """

    def __init__(self, out: Path, arch: str, *, split_max_tensors: int = 0, split_max_size: int = 0,
                 force: bool = False, tool: str = "kimi-convert", inputs: Iterable[Path] = (),
                 settings: dict[str, str] | None = None, resume: bool = False, manifest: bool = True,
                 reads: Iterable[Input] = (), reports: Iterable[tuple[Report, str]] = (),
                 log: Callable[[str], None] = lambda s: None):
        if resume and not manifest:
            raise ValueError("resume needs the manifest's journal")
        self.out = Path(out)
        self.force = force
        self.tmp_dir = partial_dir(self.out)
        self.meta = GGUFWriter(self.tmp_dir / self.out.name, arch,
                               split_max_tensors=split_max_tensors, split_max_size=split_max_size)
        self.tool, self.inputs, self.settings = tool, list(inputs), dict(settings or {})
        self.split = _split_setting(split_max_size, split_max_tensors)
        self.resume, self.manifest, self.log = resume, manifest, log
        self.journal: Path | None = None
        self.took_over = False      # the partial folder is an earlier run's, taken over by --resume
        self.reads = [*reads, *(Input(Path(p), "input file") for p in self.inputs)]
        self.reports = list(reports)    # (report, its text): committed with the file(s), or not at all

    def add_kv(self, key: str, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None):
        self.meta.add_key_value(key, value, vtype, sub_type)

    def plan_files(self, tensors: list[OutTensor]) -> list[list[OutTensor]]:
        """Assign tensors to split files exactly as GGUFWriter will (it decides), except that a change of
        `OutTensor.part` starts a new file (kimi-quantize --keep-split: one output per input part)."""
        for prev, t in zip([None, *tensors], tensors):
            if prev is not None and t.part is not None and t.part != prev.part:
                self.meta.tensors.append({})
            self.meta.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        by_name = {t.name: t for t in tensors}
        return [[by_name[n] for n in part] for part in self.meta.tensors]

    def write(self, tensors: list[OutTensor], on_bytes: Callable[[int], None] = lambda n: None) -> list[Path]:
        files = self.plan_files(tensors)
        finals = split_paths(self.out, len(files))
        refuse_overlap(self.reads, self.outputs(finals))     # --force or not: first
        check_output_paths(finals, self.force)
        if mf.manifest_path(self.out).is_dir():
            raise OutputError(f"{mf.manifest_path(self.out)}: is a folder; the manifest of {self.out} goes there")
        with contextlib.ExitStack() as settling:      # from the commit, or a failure, on: signals wait (below)
            try:
                with output_lock(self.out):
                    heads = self._headers()
                    kept = self._take_over(finals, heads)
                    entries = self._write_all(files, finals, heads, kept, on_bytes)
                    settling.enter_context(deferred())
                    self._commit(entries, finals)
            except BaseException as e:
                settling.enter_context(deferred())
                if isinstance(e, KeyboardInterrupt) and self._kept_on_interrupt():
                    raise
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
                if isinstance(e, OSError):
                    raise self._write_error(e) from None
                raise
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return finals

    def outputs(self, finals: list[Path]) -> list[Output]:
        return written_paths(self.out, finals, [r for r, _ in self.reports])

    def _kept_on_interrupt(self) -> bool:
        """Interrupted while resuming: the parts taken over from the earlier run (and those finished since)
        stay in the partial folder, which its journal lists, for the next --resume; True if so."""
        if not self.took_over:
            return False
        self.log(f"--resume: interrupted; kept {self.tmp_dir} with the finished parts its journal lists, "
                 f"for the next --resume (a run without it removes the folder)")
        return True

    def _write_error(self, e: OSError) -> OutputError:
        reason = os.strerror(e.errno) if e.errno else str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskSpaceError(f"{self.out}: disk full while writing ({reason}); nothing was written")
        if e.errno == errno.EFBIG:
            return OutputError(f"{self.out}: larger than the file system or the file size limit (ulimit -f) "
                               f"allows ({reason}); nothing was written")
        return OutputError(f"{self.out}: cannot write ({reason}); nothing was written")

    def _headers(self) -> list[bytes]:
        """Each part's bytes before its first tensor (header, keys, tensor infos, padding), made in memory by
        GGUFWriter: written at the start of the part, hashed into the plan, and what kept parts must match."""
        m = self.meta
        m.fout, m.state = [io.BytesIO() for _ in m.tensors], WriterState.EMPTY
        try:
            m.write_header_to_file()
            m.write_kv_data_to_file()
            m.write_ti_data_to_file()
            for f in m.fout:
                f.write(bytes(-f.tell() % m.data_alignment))
            return [f.getvalue() for f in m.fout]
        finally:
            m.fout = None

    def _plan(self, heads: list[bytes]) -> dict[str, str]:
        layout = hashlib.sha256(b"".join(hashlib.sha256(h).digest() for h in heads)).hexdigest()
        return {"tool": mf.tool_version(self.tool), **self.settings, "split": self.split,
                "input": mf.input_digest(self.inputs), "layout": layout}

    def _take_over(self, finals: list[Path], heads: list[bytes]) -> dict[int, mf.FileEntry]:
        """Clear the way (under the lock): partial folders of dead runs are removed, saying so; with `resume`
        the newest one with a journal of the same plan becomes ours, with the finished parts it lists that
        still check out (part index -> entry)."""
        stale = stale_partials(self.out)
        plan = self._plan(heads) if self.manifest else {}
        previous = self._resumable(stale, plan) if self.resume else None
        remove_stale([p for p in stale if previous is None or p != previous[0]], self.log)
        kept: dict[int, mf.FileEntry] = {}
        if previous is None:
            self.tmp_dir.mkdir()
        else:
            with deferred():                # the folder is ours and we know it, or it is still the earlier run's
                os.rename(previous[0], self.tmp_dir)
                self.took_over = True
            kept = self._kept_parts(previous[0], previous[1], finals, heads)
        if self.manifest:
            self.journal = mf.start_journal(self.tmp_dir, plan, [kept[i] for i in sorted(kept)])
        return kept

    def _resumable(self, stale: list[Path], plan: dict[str, str]) -> tuple[Path, list[mf.FileEntry]] | None:
        found = [(p, j) for p in stale if (j := mf.read_journal(p)) is not None]
        if not found:
            self.log(f"--resume: no partial output of an earlier run into {self.out} (with a journal) is left; "
                     f"writing all of it")
            return None
        folder, (old_plan, entries) = max(found, key=lambda pj: _mtime(mf.journal_path(pj[0])))
        differences = mf.plan_differences(old_plan, plan)
        if differences:
            raise OutputError(f"{self.out}: --resume: {folder} was written by a run with another plan: "
                              f"{'; '.join(differences)} differ; run without --resume to remove it and start over")
        return folder, entries

    def _kept_parts(self, folder: Path, entries: list[mf.FileEntry], finals: list[Path],
                    heads: list[bytes]) -> dict[int, mf.FileEntry]:
        """The journal's finished parts whose bytes still match it (each read once and hashed); every other
        file of the folder (the part being written when the run stopped) is removed."""
        index = {p.name: i for i, p in enumerate(finals)}
        kept: dict[int, mf.FileEntry] = {}
        if entries:
            self.log(f"--resume: checking the {len(entries)} finished part(s) that the journal of {folder} lists "
                     f"({sum(e.size for e in entries):,} bytes)")
        for e in entries:
            i = index.get(e.name)
            if i is None or e.header_sha256 != hashlib.sha256(heads[i]).hexdigest():
                continue                    # not this plan's part (the plans are equal: cannot happen)
            differences, _ = mf.check_file(self.tmp_dir / e.name, e)
            if differences:
                first = differences[0].line().removeprefix(f"{e.name}: ")
                self.log(f"--resume: {e.name} is not as its journal says ({first}); writing it again")
            else:
                kept[i] = e
        keep = {finals[i].name for i in kept} | {mf.JOURNAL_NAME}
        for p in self.tmp_dir.iterdir():
            if p.name not in keep:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        self.log(f"--resume: took over {folder}, a partial output of process {folder.name.rsplit('-', 1)[1]}, "
                 f"which is gone: kept {len(kept)} of {len(finals)} part(s) "
                 f"({sum(kept[i].size for i in kept):,} bytes), each checked against its journal; writing the rest")
        return kept

    def _write_all(self, files: list[list[OutTensor]], finals: list[Path], heads: list[bytes],
                   kept: dict[int, mf.FileEntry], on_bytes) -> list[mf.FileEntry]:
        entries = dict(kept)
        if kept:
            on_bytes(sum(t.nbytes for i in kept for t in files[i]))
        todo = [i for i in range(len(files)) if i not in kept]
        with SourceFiles() as sources, Prefetch(t for i in todo for t in files[i]) as chunks:
            for i in todo:
                entries[i] = self._write_part(self.tmp_dir / finals[i].name, heads[i], files[i], chunks, sources,
                                              on_bytes)
                heads[i] = b""              # the first part's holds the vocabulary: ~10 MB on the real K3
                if self.journal is not None:
                    mf.journal_part(self.journal, entries[i])
        return [entries[i] for i in range(len(files))]

    def _write_part(self, path: Path, head: bytes, part: list[OutTensor], chunks: "Prefetch",
                    sources: "SourceFiles", on_bytes) -> mf.FileEntry:
        """One file, durable when this returns: its header, then its tensors streamed (and hashed as they
        pass), each padded to the alignment."""
        align = self.meta.data_alignment
        tensors, offset = [], len(head)
        fout = open(path, "wb")
        try:
            fout.write(head)
            with open_sink(fout, sum(mf.padded(t.nbytes, align) for t in part)) as sink:
                for t in part:
                    deliver_postponed()         # a signal a finalizer kept (interrupts.postpone) stops us here
                    sink.digest = hashlib.sha256() if self.manifest else None
                    written = 0
                    for chunk in chunks.of(t):
                        n = sink.put(chunk, sources)
                        written += n
                        on_bytes(n)
                    if written != t.nbytes:
                        raise CheckpointError(f"{t.name}: produced {written} bytes, expected {t.nbytes}")
                    sink.pad(align)
                    tensors.append((t, offset, sink.digest))
                    offset += mf.padded(t.nbytes, align)
            size = os.fstat(fout.fileno()).st_size
        except BaseException:
            with contextlib.suppress(OSError):      # a full disk fails the flush too; the first error counts
                fout.close()
            raise
        fout.close()
        if size != offset:
            raise OutputError(f"{path}: {size} bytes written, the layout has {offset} (please report)")
        entries = [mf.TensorEntry(t.name, t.qtype.name, tuple(int(d) for d in t.shape), at, t.nbytes,
                                  digest.hexdigest() if digest is not None else "")      # complete now
                   for t, at, digest in tensors]
        return mf.FileEntry(path.name, size, len(head), hashlib.sha256(head).hexdigest(), entries)

    def _commit(self, entries: list[mf.FileEntry], finals: list[Path]) -> None:
        """The parts, then the manifest (never one without its files), renamed into place; then the folder
        synced, so that the renames survive a power cut."""
        temps = [self.tmp_dir / p.name for p in finals]
        reports = [staged for r, text in self.reports if (staged := r.stage(self.tmp_dir, text)) is not None]
        temps, finals = [*temps, *(t for t, _ in reports)], [*finals, *(f for _, f in reports)]
        target = mf.manifest_path(self.out)
        if self.manifest:
            mf.write_manifest(self.tmp_dir / target.name, mf.Manifest(mf.tool_version(self.tool), entries))
            _commit([*temps, self.tmp_dir / target.name], [*finals, target])
        else:
            target.unlink(missing_ok=True)      # an earlier file's manifest (--force) would not describe this one
            _commit(temps, finals)
        with contextlib.suppress(OSError):
            fd = os.open(self.out.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _mtime(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _commit(temps: list[Path], finals: list[Path]) -> None:
    """Rename the finished parts into place: all of them, or (a failure, a signal) none."""
    try:
        for tmp, final in zip(temps, finals):
            os.replace(tmp, final)
    except BaseException:
        for tmp, final in zip(temps, finals):
            if not tmp.exists():            # renamed already
                final.unlink(missing_ok=True)
        raise


class Prefetch:
    """Runs the tensors' chunk producers (reads, casts, MXFP4 repacks) one step ahead in a thread.

    numpy and file reads release the GIL, so the producer works on the second core while the
    main thread writes; the queue holds at most DEPTH chunks, which bounds the extra memory.
    """
    DEPTH = 3
    _END = object()

    def __init__(self, tensors: Iterable[OutTensor]):
        self.queue: queue.Queue = queue.Queue(self.DEPTH)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(list(tensors),), daemon=True)

    def _run(self, tensors: list[OutTensor]) -> None:
        try:
            for t in tensors:
                for chunk in t.chunks():
                    if not self._put((t.name, chunk)):
                        return
                if not self._put((t.name, self._END)):
                    return
        except OSError as e:            # producers only read: the source's fault, not the output's
            what = f"{e.filename}: cannot read the data of {t.name}" if e.filename else \
                f"{t.name}: cannot read its source data"
            self._put((None, CheckpointError(f"{what} ({e.strerror or e})")))
        except BaseException as e:      # handed to the writer, which raises it
            self._put((None, e))

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def of(self, t: OutTensor) -> Iterator[Chunk]:
        while True:
            name, chunk = self.queue.get()
            if name is None:
                raise chunk
            if chunk is self._END:
                return
            assert name == t.name, f"producer at {name}, writer at {t.name}"
            yield chunk

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


# how a file system (tmpfs, some FUSE and network ones) or a limit refuses an O_DIRECT open or write
DIRECT_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)


def open_sink(fout, nbytes: int | None = None) -> "DirectSink | BufferedSink":
    """Tensor data (about `nbytes` of it, if known) goes around the page cache (O_DIRECT) where the file
    system allows it."""
    try:
        return DirectSink(fout, nbytes)
    except OSError as e:            # e.g. tmpfs refuses O_DIRECT with EINVAL
        if e.errno not in DIRECT_REFUSED:
            raise
        return BufferedSink(fout)


class BufferedSink:
    """Plain buffered writes, flushed in the background as they go.

    Both sinks hash what they write into `digest` when the writer sets one (the manifest's per-tensor
    SHA-256), from the bytes on their way to the file: no second pass over the output."""
    HASH_BLOCK = 8 << 20          # a file range is read through a buffer this size when it is hashed
    WRITEBACK = 256 << 20         # flushed in the background after this many bytes (_Writeback)

    def __init__(self, fout, nbytes: int | None = None):
        self.fout = fout
        self.writeback = _Writeback(fout.fileno(), self.WRITEBACK, fout.flush)
        self.digest = None
        self._buf: memoryview | None = None

    def put(self, chunk: Chunk, sources: "SourceFiles") -> int:
        if self.digest is None:
            n = _write_chunk(self.fout, chunk, sources)
        elif isinstance(chunk, FileRange):
            n = self._copy_hashed(chunk, sources.fd(chunk.path))
        else:
            data = _bytes_view(chunk)
            self.digest.update(data)
            n = self.fout.write(data)
        self.writeback.wrote(n)
        return n

    def _copy_hashed(self, r: FileRange, src: int) -> int:
        """A file range read once through a buffer, hashed and written (instead of copy_file_range, which
        never shows the bytes)."""
        if self._buf is None:
            self._buf = memoryview(bytearray(self.HASH_BLOCK))
        offset, left = r.offset, r.length
        while left:
            view = self._buf[:min(left, self.HASH_BLOCK)]
            try:
                n = os.preadv(src, [view], offset)
            except OSError as e:
                raise CheckpointError(f"{r.path}: cannot read ({e.strerror or e})") from None
            if n == 0:
                raise CheckpointError(f"{r.path}: ends before byte {offset + left} (truncated shard?)")
            self.digest.update(view[:n])
            self.fout.write(view[:n])
            offset, left = offset + n, left - n
        return r.length

    def pad(self, align: int) -> None:
        _pad(self.fout, align)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.writeback.__exit__(*exc)


class DirectSink:
    """Tensor data through three page-aligned staging buffers (32 MB, or less for a smaller file:
    stage_size), written with O_DIRECT by an I/O thread while the next buffer fills.

    Buffered writes of a multi-GB file spend most of their time copying into fresh page-cache
    pages (and then reclaiming them); O_DIRECT hands the staging buffer to the disk instead. The
    file offset of the first data byte is rarely page-aligned, so the staging starts with the
    page of header bytes in front of it, and the last partial page is written zero-padded and
    the file truncated back to its length.

    A write that O_DIRECT refuses (EINVAL: a file system that takes the flag at open but not
    the write, or a file size limit that is not a multiple of the page) or cuts short is done
    again, and every later one, with plain buffered writes: they either succeed or fail with
    the real reason (EFBIG, ENOSPC).

    The manifest's hashes are taken by a hashing thread between the two, from each staging buffer
    before it goes to the I/O thread (the tensor bytes of it, in order): filling, hashing and writing
    then overlap, one buffer each. A tensor's `digest` is complete once the sink has closed.
    """
    PAGE = 4096
    STAGE = 32 << 20
    MIN_STAGE = 1 << 20
    BUFFERS = 3

    def __init__(self, fout, nbytes: int | None = None):
        fout.flush()
        self.fout, pos = fout, fout.tell()
        self.fd = os.open(fout.name, os.O_WRONLY | os.O_DIRECT)
        self.direct = True
        self.stage = self.stage_size(nbytes)
        self.writeback = _Writeback(self.fd, self.stage)     # each buffer flushed while the next is made
        self.file_off = pos - pos % self.PAGE          # where the current buffer lands
        self.free: queue.Queue = queue.Queue()
        for _ in range(self.BUFFERS):
            self.free.put(_staging_buffer(self.stage))
        self.todo: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.digest = None                            # set by the writer per tensor: see BufferedSink
        self.segments: list[list] = []                # [digest, start, end] of the tensor bytes in self.buf
        self.buf, self.fill = self.free.get(), 0
        reader = os.open(fout.name, os.O_RDONLY)
        try:
            head = os.pread(reader, pos - self.file_off, self.file_off)
        finally:
            os.close(reader)
        self._stage(memoryview(head), hashed=False)
        self.to_hash: queue.Queue = queue.Queue()
        self.hasher = threading.Thread(target=self._hash, daemon=True)
        self.io = threading.Thread(target=self._io, daemon=True)
        self.hasher.start()
        self.io.start()

    @classmethod
    def stage_size(cls, nbytes: int | None) -> int:
        """The power of two at or under nbytes / 16, from MIN_STAGE to STAGE (STAGE if nbytes is unknown).
        Memory a process touches for the first time is the dear part here: a fresh 32 MB buffer took
        37-62 ms to fill once and 5-7 ms each time after (the 2-core VM), so three of them cost a 0.14 GB
        quantized file 0.15-0.2 s of the writer's core; and the last buffers, written and flushed after the
        last byte is made, take less time the smaller they are."""
        if nbytes is None:
            return cls.STAGE
        return min(cls.STAGE, max(cls.MIN_STAGE, 1 << max(0, (nbytes // 16).bit_length() - 1)))

    @classmethod
    def staging_bytes(cls, nbytes: int) -> int:
        """The staging memory a write of nbytes touches: its buffers, as far as the data fills them."""
        return min(nbytes, cls.BUFFERS * cls.stage_size(nbytes))

    @property
    def position(self) -> int:
        return self.file_off + self.fill

    def put(self, chunk: Chunk, sources: "SourceFiles") -> int:
        if isinstance(chunk, FileRange):
            return self._stage_range(chunk, sources.fd(chunk.path))
        data = _bytes_view(chunk)
        self._stage(data)
        return len(data)

    def pad(self, align: int) -> None:
        if self.position % align:
            self._stage(memoryview(bytes(align - self.position % align)), hashed=False)

    def _stage(self, data: memoryview, hashed: bool = True) -> None:
        while len(data):
            n = min(self.stage - self.fill, len(data))
            # numpy's copy lets go of the GIL (an mmap slice assignment holds it), so the quantizer's
            # threads, which take it back after every kernel call, do not wait on this copy
            np.frombuffer(self.buf, np.uint8, n, self.fill)[:] = np.frombuffer(data, np.uint8, n)
            if hashed:
                self._to_hash(n)
            self.fill += n
            data = data[n:]
            if self.fill == self.stage:
                self._submit()

    def _to_hash(self, n: int) -> None:
        """The n bytes staged at self.fill belong to the current tensor's digest."""
        if self.digest is None:
            return
        if self.segments and self.segments[-1][0] is self.digest and self.segments[-1][2] == self.fill:
            self.segments[-1][2] += n
        else:
            self.segments.append([self.digest, self.fill, self.fill + n])

    def _stage_range(self, r: FileRange, src: int) -> int:
        offset, left = r.offset, r.length
        while left:
            view = memoryview(self.buf)[self.fill:self.fill + min(left, self.stage - self.fill)]
            try:
                n = os.preadv(src, [view], offset)
            except OSError as e:
                raise CheckpointError(f"{r.path}: cannot read ({e.strerror or e})") from None
            finally:
                view.release()
            if n == 0:
                raise CheckpointError(f"{r.path}: ends before byte {offset + left} (truncated shard?)")
            self._to_hash(n)
            self.fill, offset, left = self.fill + n, offset + n, left - n
            if self.fill == self.stage:
                self._submit()
        return r.length

    def _submit(self) -> None:
        if self.error is not None:
            raise self.error
        self.to_hash.put((self.buf, self.fill, self.file_off, self.segments))
        self.file_off += self.fill
        self.buf, self.fill, self.segments = self.free.get(), 0, []

    def _hash(self) -> None:
        """Hash each buffer's tensor bytes (if the writer asked for digests), then hand it on to the I/O thread."""
        while (item := self.to_hash.get()) is not None:
            try:
                if self.error is None:
                    _hash_segments(item[0], item[3])
            except BaseException as e:      # raised in the writer's thread at the next submit
                self.error = e
            self.todo.put(item)
        self.todo.put(None)

    def _io(self) -> None:
        while (item := self.todo.get()) is not None:
            buf, n, offset, _ = item
            try:
                if self.error is None:
                    self._write(buf, n, offset)
                    self.writeback.wrote(n)
            except BaseException as e:      # raised in the writer's thread at the next submit
                self.error = e
            self.free.put(buf)

    def _write(self, buf: mmap.mmap, n: int, offset: int) -> None:
        with memoryview(buf) as view:
            if self.direct:
                length = -(-n // self.PAGE) * self.PAGE       # whole pages; the tail is zeros
                buf[n:length] = bytes(length - n)
                try:
                    if os.pwrite(self.fd, view[:length], offset) == length:
                        return
                except OSError as e:
                    if e.errno not in DIRECT_REFUSED:
                        raise
                self._fall_back_to_buffered()
            _pwrite_all(self.fd, view[:n], offset)

    def _fall_back_to_buffered(self) -> None:
        self.writeback.wait()               # its flush is on the descriptor closed here
        os.close(self.fd)
        self.fd = os.open(self.fout.name, os.O_WRONLY)
        self.direct = False
        self.writeback.fd = self.fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        end = self.position
        if exc[0] is None and self.fill:
            self._submit()
        self.to_hash.put(None)              # the hasher passes the end on to the I/O thread
        self.hasher.join()
        self.io.join()
        self.writeback.join()               # before the descriptor is closed, whatever happens
        try:
            if exc[0] is None:
                if self.error is not None:
                    raise self.error
                self.writeback.wait()
                os.ftruncate(self.fd, end)
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
        self.fout.seek(end)


def _staging_buffer(n: int) -> mmap.mmap:
    """n bytes of private anonymous memory, page-aligned, in huge pages where the kernel allows them: 8,192
    page faults to fill a 32 MB buffer become 16, and unmapping it at the end is cheap. (A shared anonymous
    map, mmap's default, is shmem, which takes no huge pages here: unmapping three of them took 30-40 ms
    at the end of every write.)"""
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _hash_segments(buf: mmap.mmap, segments: list[list]) -> None:
    with memoryview(buf) as view:
        for digest, start, end in segments:
            with view[start:end] as part:
                digest.update(part)             # hashlib lets go of the GIL on large buffers


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of data; a short write is retried, so a full disk ends in its own error."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        data, offset = data[n:], offset + n


class _Writeback:
    """Flush to disk in the background every `every` bytes written, so the closing fsync is short and
    dirty data does not pile up: a flush costs about as much per byte whenever it runs (an fdatasync of
    160 MB written with O_DIRECT took 204-272 ms at the end, or 224-287 ms spread over five syncs on a
    thread and then 0 ms at the end, docs/performance.md), so done meanwhile it is off the critical path.
    The final fsync still makes the file durable before its rename. One flush runs at a time; bytes
    written while it runs go into the next. `flush` empties the writer's own buffer first (a file object's)."""

    def __init__(self, fd: int, every: int, flush: Callable[[], None] = lambda: None):
        self.fd, self.every, self.flush = fd, every, flush
        self.pending, self.syncer = 0, None
        self.error: OSError | None = None

    def wrote(self, n: int) -> None:
        self.pending += n
        if self.pending >= self.every and (self.syncer is None or not self.syncer.is_alive()):
            self.flush()
            self.syncer = threading.Thread(target=self._sync, args=(self.fd,), daemon=True)
            self.syncer.start()
            self.pending = 0

    def _sync(self, fd: int) -> None:
        try:
            os.fdatasync(fd)
        except OSError as e:
            # kept for the close: Linux reports a write-back error to a descriptor once, so the closing
            # fsync could succeed after this one failed, and the file would be renamed into place short
            self.error = self.error or e

    def join(self) -> None:
        """Wait for the flush under way (before its descriptor is closed)."""
        if self.syncer is not None:
            self.syncer.join()

    def wait(self) -> None:
        """join(), then raise the error of any flush that failed."""
        self.join()
        if self.error is not None:
            raise self.error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            self.join()
            return
        self.wait()
        self.flush()
        os.fsync(self.fd)


def _pad(fout, align: int) -> None:
    pos = fout.tell()
    if pos % align:
        fout.write(b"\0" * (align - pos % align))


class SourceFiles:
    """Open source files once each, for FileRange copies."""

    def __init__(self):
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            try:
                self.fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open ({e.strerror or e})") from None
        return self.fds[path]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for fd in self.fds.values():
            os.close(fd)


def _bytes_view(chunk) -> memoryview:
    """The bytes of an array or buffer chunk, without a copy when it is contiguous."""
    if isinstance(chunk, np.ndarray):
        chunk = np.ascontiguousarray(chunk)
    return memoryview(chunk).cast("B")


def _write_chunk(fout, chunk: Chunk, sources: SourceFiles) -> int:
    if isinstance(chunk, FileRange):
        return copy_range(fout, chunk, sources.fd(chunk.path))
    if isinstance(chunk, np.ndarray):
        chunk = memoryview(np.ascontiguousarray(chunk)).cast("B")
    fout.write(chunk)
    return len(chunk)


def copy_range(fout, r: FileRange, src: int) -> int:
    """Copy r.length bytes at r.offset into fout's current position."""
    fout.flush()
    dst = fout.fileno()
    offset, left = r.offset, r.length
    try:
        while left:
            n = os.copy_file_range(src, dst, min(left, 1 << 30), offset)
            if n == 0:
                raise CheckpointError(f"{r.path}: ends before byte {offset + left} (truncated shard?)")
            offset, left = offset + n, left - n
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        while left:  # the kernel cannot copy between these files: plain reads
            data = os.pread(src, min(left, COPY_CHUNK), offset)
            if not data:
                raise CheckpointError(f"{r.path}: ends before byte {offset + left} (truncated shard?)")
            os.write(dst, data)
            offset, left = offset + len(data), left - len(data)
    fout.seek(0, os.SEEK_END)
    return r.length

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

The pieces live beside it: chunks.py (what a tensor's bytes are: arrays, buffers, file ranges), output.py (paths,
partial folders, the lock, free disk) and sinks.py (O_DIRECT and buffered writes, background flushes).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import queue
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as QT
from gguf.gguf_writer import WriterState

from ..errors import CheckpointError, DiskSpaceError, OutputError
from ..interrupts import deferred, deliver_postponed
from ..paths import Input, Output, Report, refuse_overlap
from ..cores import threads_or_all
from . import manifest as mf
from .digest import TREE, TreeDigest
from .chunks import COPY_CHUNK, Chunk, FileRange, SourceFiles, copy_range, tensor_nbytes  # noqa: F401
from .output import (HEADROOM, MIN_SPLIT_SIZE, DiskRoom, check_free_disk, check_output_paths,  # noqa: F401
                     check_split_max_size, disk_bytes, disk_room, lock_path, output_lock, partial_dir, remove_stale,
                     split_paths, stale_partials, written_paths)
from .sinks import BufferedSink, DirectSink, open_sink  # noqa: F401  (tests replace writer.open_sink)


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
    `manifest=False` hashes nothing and writes no manifest (measuring what hashing costs); `threads` (0: every
    CPU) hash the manifest's digests side by side (digest.py).
    `reads` are the other files the run reads (a policy, an imatrix, ...): no path it writes may be one of them, nor
    one of `inputs` (paths.refuse_overlap). `reports` are renamed into place with the file(s) (paths.Report).
    """

    def __init__(self, out: Path, arch: str, *, split_max_tensors: int = 0, split_max_size: int = 0,
                 force: bool = False, tool: str = "kimi-convert", inputs: Iterable[Path] = (),
                 settings: dict[str, str] | None = None, resume: bool = False, manifest: bool = True,
                 reads: Iterable[Input] = (), reports: Iterable[tuple[Report, str]] = (),
                 log: Callable[[str], None] = lambda s: None, threads: int = 0):
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
        self.threads = threads_or_all(threads)          # the manifest's hashing (digest.py)
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
        return {"tool": mf.tool_version(self.tool), "hash": TREE, **self.settings, "split": self.split,
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
            differences, _ = mf.check_file(self.tmp_dir / e.name, e, TREE, self.threads)
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
                    sink.digest = TreeDigest(self.threads) if self.manifest else None
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

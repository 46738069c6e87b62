"""Per-tensor SHA-256 (tree) manifests of the GGUF files we write, the resume journal, and checking files offline.

The streaming writer hashes each tensor's bytes as they go to disk (no second pass over the output) and
writes `OUT.gguf.manifest.json` beside the output, renamed into place after the file(s) it describes (one
manifest for a split set). While it writes, it records each finished part in a journal inside its partial
folder; `--resume` keeps the parts the journal lists (re-checked here) when the run's plan is the same.
`check_manifest` checks a file or a split set against a manifest: every tensor, the header, the sizes and
the padding, each byte read once, without the checkpoint. The format is in docs/formats.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import CheckpointError
from ..paths import helper_stem
from .digest import FLAT, SCHEMES, TREE, new_digest
from .qtypes import QUANT_SIZES, TYPES_BY_NAME

MANIFEST_FORMAT = "kimi-convert GGUF manifest"
MANIFEST_VERSION = 1
JOURNAL_NAME = "manifest.journal"       # inside the partial folder: the plan, then one line per finished part
READ_BLOCK = 8 << 20                     # bytes hashed per read when checking
MAX_MANIFEST = 256 << 20                 # ~150 bytes a tensor: 497,220 tensors would take 75 MB
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(CheckpointError):
    """A manifest or journal that is not one we write (damaged, edited, another format)."""


def manifest_path(out: Path) -> Path:
    """Where the manifest of `out` (and of its split parts) goes: OUT.gguf.manifest.json (paths.helper_stem: the
    name shortened, with a hash of it, where that would be too long for the file system)."""
    out = Path(out)
    return out.with_name(helper_stem(out) + ".manifest.json")


def tool_version(tool: str) -> str:
    from .. import __version__
    return f"{tool} {__version__}"


def padded(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type: str                   # ggml type name, e.g. BF16, Q8_0
    shape: tuple[int, ...]      # numpy order (the reverse of ggml's ne), as the reader gives it
    offset: int                 # absolute, in its file
    nbytes: int
    sha256: str

    def to_json(self) -> dict:
        return {"name": self.name, "type": self.type, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, "sha256": self.sha256}


@dataclass
class FileEntry:
    name: str                   # a plain file name, beside the manifest's output
    size: int
    header_bytes: int           # where the first tensor starts: the header, keys, tensor infos, padding
    header_sha256: str          # of bytes [0, header_bytes)
    tensors: list[TensorEntry] = field(default_factory=list)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "header_bytes": self.header_bytes,
                "header_sha256": self.header_sha256, "tensors": [t.to_json() for t in self.tensors]}

    def dumps(self, indent: str = "") -> str:
        """Compact JSON, one tensor a line (a diff of two manifests reads tensor by tensor)."""
        head = json.dumps({k: v for k, v in self.to_json().items() if k != "tensors"})[:-1]
        rows = f",\n{indent}  ".join(json.dumps(t.to_json()) for t in self.tensors)
        return f'{head}, "tensors": [\n{indent}  {rows}\n{indent}]}}' if rows else f'{head}, "tensors": []}}'


@dataclass
class Manifest:
    tool: str
    files: list[FileEntry]
    hash: str = TREE            # how each tensor's "sha256" is taken (digest.py): TREE, or FLAT before it

    def dumps(self) -> str:
        files = ",\n  ".join(f.dumps("  ") for f in self.files)
        return (f'{{"format": {json.dumps(MANIFEST_FORMAT)}, "version": {MANIFEST_VERSION}, '
                f'"tool": {json.dumps(self.tool)}, "hash": {json.dumps(self.hash)},\n "files": [\n  {files}\n ]}}\n')


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write and fsync (the writer renames it into place after the files it describes)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(manifest.dumps())
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------ reading

class _Fault(Exception):
    pass


def _get(obj: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(obj, dict):
        raise _Fault(f"{where}: not a JSON object")
    if key not in obj:
        raise _Fault(f"{where}: {key!r} is missing")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _Fault(f"{where}: {key!r} is {json.dumps(value)[:40]}, expected {_KIND[kind]}")
    if kind is int and value < 0:
        raise _Fault(f"{where}: {key!r} is negative ({value})")
    return value


_KIND = {int: "a non-negative integer", str: "a string", list: "a list", dict: "an object"}


def _digest(obj: dict, key: str, where: str) -> str:
    value = _get(obj, key, str, where)
    if not _SHA256.fullmatch(value):
        raise _Fault(f"{where}: {key!r} is not a SHA-256 (64 lowercase hex digits)")
    return value


def _tensor(obj: Any, where: str) -> TensorEntry:
    name = _get(obj, "name", str, where)
    where = f"tensor {name}"
    qtype = _get(obj, "type", str, where)
    if qtype not in TYPES_BY_NAME:
        raise _Fault(f"{where}: unknown type {qtype!r}")
    shape = _get(obj, "shape", list, where)
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise _Fault(f"{where}: shape {shape} is not a list of positive integers")
    nbytes = _get(obj, "nbytes", int, where)
    block, size = QUANT_SIZES[TYPES_BY_NAME[qtype]]
    n = 1
    for d in shape[:-1]:
        n *= d
    if shape[-1] % block or n * (shape[-1] // block) * size != nbytes:
        raise _Fault(f"{where}: {nbytes} bytes do not match its type {qtype} and shape {shape}")
    return TensorEntry(name, qtype, tuple(shape), _get(obj, "offset", int, where), nbytes,
                       _digest(obj, "sha256", where))


def _file(obj: Any, where: str) -> FileEntry:
    name = _get(obj, "name", str, where)
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise _Fault(f"{where}: name {name!r} is not a plain file name")
    where = f"file {name}"
    entry = FileEntry(name, _get(obj, "size", int, where), _get(obj, "header_bytes", int, where),
                      _digest(obj, "header_sha256", where),
                      [_tensor(t, f"{where}: tensor {i + 1}") for i, t in enumerate(_get(obj, "tensors", list, where))])
    end = entry.header_bytes
    for t in sorted(entry.tensors, key=lambda t: t.offset):
        if t.offset < end:
            raise _Fault(f"{where}: tensor {t.name} at byte {t.offset} overlaps the bytes before it (up to {end})")
        end = t.offset + t.nbytes
    if end > entry.size:
        raise _Fault(f"{where}: its tensors end at byte {end}, beyond its size {entry.size}")
    return entry


def load_manifest(path: Path) -> Manifest:
    """A manifest we wrote, checked field by field: a damaged one is one ManifestError naming the field."""
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{path}: not a regular file, not a manifest")
        if st.st_size > MAX_MANIFEST:
            raise ManifestError(f"{path}: {st.st_size:,} bytes, too large for a manifest (at most {MAX_MANIFEST:,})")
        raw = path.read_bytes()
        if raw[:4] == b"GGUF":
            raise ManifestError(f"{path}: a GGUF file, not its manifest (that is {manifest_path(path).name})")
        obj = json.loads(raw)
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the manifest ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:        # bad UTF-8 or JSON, a 5000-digit number, deep nesting
        raise ManifestError(f"{path}: not a manifest: not valid JSON ({e})") from None
    try:
        if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
            raise _Fault(f"not a manifest: 'format' is not {MANIFEST_FORMAT!r}")
        if obj.get("version") != MANIFEST_VERSION:
            raise _Fault(f"manifest version {obj.get('version')!r}: only version {MANIFEST_VERSION} is known")
        if obj.get("hash") not in SCHEMES:
            raise _Fault(f"hash {obj.get('hash')!r}: only {' and '.join(SCHEMES)} are known")
        files = [_file(f, f"file {i + 1}") for i, f in enumerate(_get(obj, "files", list, "the manifest"))]
        if not files:
            raise _Fault("it lists no files")
        _unique((f.name for f in files), "file")
        _unique((t.name for f in files for t in f.tensors), "tensor")
        return Manifest(_get(obj, "tool", str, "the manifest"), files, obj["hash"])
    except _Fault as e:
        fault = str(e)
    raise ManifestError(f"{path}: {fault}")


def _unique(names: Iterable[str], what: str) -> None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise _Fault(f"{what} {n} is listed twice")
        seen.add(n)


# ------------------------------------------------------------------------------------------ the journal

def journal_path(partial: Path) -> Path:
    return Path(partial) / JOURNAL_NAME


def start_journal(partial: Path, plan: dict[str, str], kept: Iterable[FileEntry]) -> Path:
    """A new journal (the plan, then the parts kept by a resume), written whole and renamed into place."""
    path = journal_path(partial)
    tmp = path.with_name(path.name + ".new")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"plan": plan}) + "\n")
        for entry in kept:
            f.write(json.dumps(entry.to_json()) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def journal_part(path: Path, entry: FileEntry) -> None:
    """Record a finished part (its file is already fsynced): one line, fsynced before the next part starts."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry.to_json()) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_journal(partial: Path) -> tuple[dict[str, str], list[FileEntry]] | None:
    """(plan, finished parts) of a partial folder, or None if it has no readable journal. A last line cut by
    SIGKILL or a power cut is ignored (its part is written again)."""
    try:
        lines = journal_path(partial).read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError):
        return None
    try:
        plan = json.loads(lines[0])["plan"]
        if not isinstance(plan, dict) or not all(isinstance(v, str) for v in plan.values()):
            return None
    except (ValueError, RecursionError, KeyError, TypeError):
        return None
    entries = []
    for line in lines[1:]:
        try:
            entries.append(_file(json.loads(line), "journal"))
        except (ValueError, RecursionError, _Fault):
            break
    return plan, entries


def input_digest(paths: Iterable[Path]) -> str:
    """What identifies the run's input files without reading them: each one's path, size and mtime."""
    rows = []
    for p in paths:
        try:
            st = os.stat(p)
            rows.append([str(Path(p).absolute()), st.st_size, st.st_mtime_ns])
        except OSError:
            rows.append([str(Path(p).absolute()), None, None])
    return hashlib.sha256(json.dumps(sorted(rows)).encode()).hexdigest()


PLAN_WORDS = {"tool": "tool version", "input": "input files (path, size or time)",
              "layout": "output layout (tensors, types, metadata)", "split": "split"}


def plan_differences(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What differs between two runs' plans, in words (`then` and `now` for the short values)."""
    out = []
    for key in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        word = PLAN_WORDS.get(key, key)
        if key in ("input", "layout"):
            out.append(word)
        else:
            out.append(f"{word} ({a or 'none'} then, {b or 'none'} now)")
    return out


# ------------------------------------------------------------------------------------------ checking

@dataclass(frozen=True)
class Difference:
    file: str
    what: str
    tensor: str | None = None
    kind: str = "file"          # tensor, missing (the file), extra (file), size, header, padding, file

    def line(self) -> str:
        return f"{self.file}: " + (f"tensor {self.tensor}: " if self.tensor else "") + self.what


@dataclass
class CheckResult:
    manifest: Path
    files: list[FileEntry]
    differences: list[Difference]
    bytes_read: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.differences

    @property
    def n_tensors(self) -> int:
        return sum(len(f.tensors) for f in self.files)

    def summary(self) -> str:
        where = f"{len(self.files)} file(s) of {self.manifest.name}"
        if self.ok:
            return (f"PASS: all {self.n_tensors} tensors, the headers and the sizes of {where} match "
                    f"({self.bytes_read:,} bytes read in {self.seconds:.1f} s)")
        count = {k: sum(d.kind == k for d in self.differences)
                 for k in ("tensor", "missing", "extra", "size", "header", "padding", "file")}
        missing = {d.file for d in self.differences if d.kind == "missing"}
        unchecked = sum(len(f.tensors) for f in self.files if f.name in missing)
        words = {"missing": "file(s) missing", "extra": "extra file(s)", "size": "size(s) wrong",
                 "header": "header(s) differ", "padding": "padding(s) not zeros", "file": "unreadable file(s)"}
        rest = [f"{count[k]} {w}" for k, w in words.items() if count[k]]
        return (f"FAIL: {count['tensor']} of {self.n_tensors} tensors differ"
                + (f" ({unchecked} more not checked: their file is missing)" if unchecked else "")
                + "".join(f", {r}" for r in rest) + f"; {where}")

    def to_json(self) -> dict:
        return {"manifest": str(self.manifest), "ok": self.ok, "files": [f.name for f in self.files],
                "tensors": self.n_tensors, "bytes_read": self.bytes_read,
                "differences": [{"file": d.file, "kind": d.kind, "tensor": d.tensor, "what": d.what}
                                for d in self.differences]}


class _Reader:
    """Hashes byte ranges of one open file through one reused buffer."""

    def __init__(self, fd: int, size: int, threads: int = 1):
        self.fd, self.size, self.bytes_read, self.threads = fd, size, 0, threads
        self.buf = memoryview(bytearray(READ_BLOCK))

    def sha256(self, offset: int, nbytes: int, scheme: str = FLAT) -> str:
        """The digest of bytes [offset, offset + nbytes) by the manifest's `scheme` (digest.py); a block's
        leaves are hashed on the reader's threads at once."""
        h = new_digest(scheme, self.threads)
        for part in self.blocks(offset, nbytes):
            h.update(part)          # hashlib lets go of the GIL on large buffers
        return h.hexdigest()

    def is_zero(self, offset: int, nbytes: int) -> bool:
        return all(not any(part) for part in self.blocks(offset, nbytes))

    def blocks(self, offset: int, nbytes: int):
        end = offset + nbytes
        while offset < end:
            n = os.preadv(self.fd, [self.buf[:min(READ_BLOCK, end - offset)]], offset)
            if n == 0:
                raise EOFError
            self.bytes_read += n
            yield self.buf[:n]
            offset += n


def check_file(path: Path, entry: FileEntry, scheme: str = TREE, threads: int = 1) -> tuple[list[Difference], int]:
    """Every way `path` differs from its manifest entry (size, header, each tensor, padding), and the bytes
    read, the tensors hashed by the manifest's `scheme` on `threads`. Tensors are read at the manifest's
    offsets, so a damaged header does not hide them."""
    diffs: list[Difference] = []
    name = entry.name

    def differs(what: str, tensor: str | None = None, kind: str = "file") -> None:
        diffs.append(Difference(name, what, tensor, "tensor" if tensor else kind))

    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            differs("not a regular file")
            return diffs, 0
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        differs(f"missing (its {len(entry.tensors)} tensors not checked)", kind="missing")
        return diffs, 0
    except OSError as e:
        differs(f"cannot read it ({e.strerror or e})")
        return diffs, 0
    try:
        reader = _Reader(fd, st.st_size, threads)
        _check_contents(path, entry, reader, differs, scheme)
    except OSError as e:
        differs(f"read error ({e.strerror or e})")
    except EOFError:
        differs("it shrank while it was being checked")
    finally:
        os.close(fd)
    return diffs, reader.bytes_read


def _check_contents(path: Path, entry: FileEntry, reader: _Reader, differs, scheme: str) -> None:
    size = reader.size
    if size != entry.size:
        how = "truncated" if size < entry.size else "longer"
        differs(f"{how}: {size:,} bytes, the manifest says {entry.size:,}", kind="size")
    notes = _table_differences(path, entry)
    if size < entry.header_bytes or reader.sha256(0, entry.header_bytes) != entry.header_sha256:
        differs("the header (keys and tensor infos) differs" + ("; " + "; ".join(notes[:5]) if notes else
                " (its tensor table agrees: the keys or the padding differ)")
                + (f"; and {len(notes) - 5} more" if len(notes) > 5 else ""), kind="header")
    elif size == entry.size:    # the header hashed, but the manifest's table is not its table (an edited one)
        for note in notes:      # (a cut file does not parse for its data's sake: its size said it already)
            differs(f"the manifest does not match the file's header: {note}", kind="header")
    end = entry.header_bytes
    for t in sorted(entry.tensors, key=lambda t: t.offset):
        _check_gap(reader, end, min(t.offset, size), differs)
        if t.offset + t.nbytes > size:
            differs(f"cut off: it ends at byte {t.offset + t.nbytes:,}, the file at {size:,}", t.name)
        elif (found := reader.sha256(t.offset, t.nbytes, scheme)) != t.sha256:
            differs(f"{t.type}{list(t.shape)} at byte {t.offset:,}: its bytes differ (sha256 {found[:12]}..., "
                    f"the manifest's {t.sha256[:12]}...)", t.name)
        end = max(end, t.offset + t.nbytes)
    _check_gap(reader, end, min(entry.size, size), differs)


def _check_gap(reader: _Reader, start: int, end: int, differs) -> None:
    """Alignment padding between tensors is zeros (so every byte of the file is covered)."""
    if end > start and not reader.is_zero(start, end - start):
        differs(f"padding at bytes {start:,}..{end - 1:,} is not zeros", kind="padding")


def _table_differences(path: Path, entry: FileEntry) -> list[str]:
    """How the file's own tensor table (read by the one GGUF reader) differs from the manifest's."""
    from .reader import read_gguf
    try:
        gf = read_gguf(path)
    except CheckpointError as e:
        return [f"it does not parse: {str(e).removeprefix(f'{path}: ')}"]
    stored = {t.name: t for t in gf.tensors.values()}
    wanted = {t.name: t for t in entry.tensors}
    notes = [f"tensor {n} is not in the manifest" for n in stored if n not in wanted]
    notes += [f"tensor {n} is missing from the file" for n in wanted if n not in stored]
    for n, w in wanted.items():
        s = stored.get(n)
        if s is not None and (s.qtype.name, tuple(s.shape), s.offset) != (w.type, w.shape, w.offset):
            notes.append(f"tensor {n} is {s.qtype.name}{list(s.shape)} at byte {s.offset:,} in the file, "
                         f"{w.type}{list(w.shape)} at byte {w.offset:,} in the manifest")
    return notes


_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def check_manifest(file: Path, manifest_file: Path, threads: int = 0) -> CheckResult:
    """Check `file` (a single GGUF or any part of a split set) and the other files its manifest lists, found
    beside it, hashing on `threads` (0: every CPU). Files of the same split set that the manifest does not
    list are differences too."""
    from ..cores import threads_or_all
    file, manifest_file = Path(file), Path(manifest_file)
    manifest = load_manifest(manifest_file)
    names = [f.name for f in manifest.files]
    if file.name not in names:
        raise ManifestError(f"{file}: not one of the files {manifest_file} describes ({', '.join(names[:4])}"
                            f"{', ...' if len(names) > 4 else ''})")
    if file.is_dir():
        raise ManifestError(f"{file}: a folder, not a GGUF file")
    start, diffs, read = time.perf_counter(), [], 0
    for entry in manifest.files:
        found, n = check_file(file.parent / entry.name, entry, manifest.hash, threads_or_all(threads))
        diffs += found
        read += n
    diffs += [Difference(p.name, "not in the manifest (a part of the same split set)", kind="extra")
              for p in _siblings(file) if p.name not in names]
    return CheckResult(manifest_file, manifest.files, diffs, read, time.perf_counter() - start)


def _siblings(file: Path) -> list[Path]:
    """Every part of the split set `file` belongs to that is on disk, whatever its count says."""
    m = _SPLIT.match(file.name)
    if not m:
        return []
    pattern = re.compile(re.escape(m["stem"]) + r"-\d{5}-of-\d{5}\.gguf")
    try:
        return sorted(p for p in file.parent.iterdir() if pattern.fullmatch(p.name))
    except OSError:
        return []

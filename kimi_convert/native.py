"""Our numba kernels as native code that a process loads without importing numba.

``import numba`` and the registries numba fills before it loads its first kernel cost 0.7-0.8 s of every
process here (0.34-0.39 s, then 0.38 s, measured on the 2-core VM; docs/performance.md), about half of
llama-quantize's whole run on a 0.5 GB file. The kernels stay numba source, their one implementation; this
module changes only how a process gets their machine code:

* build, once per kernel, kernel source, numba/llvmlite/Python version and CPU: numba compiles a C entry
  point for the kernel (``numba.cfunc``: the kernel called on ``carray`` views of raw pointers), and that
  entry's object code, the code numba's own cache keeps, goes to the cache folder;
* load, in every later process: llvmlite's MCJIT links the cached object into the process, as numba does
  with its own cache, once the C helpers numba's code calls (its ``_helperlib``, ``_dynfunc`` and NRT
  extension modules, loaded from their files, with no ``import numba``) and the Python objects it names
  are known to LLVM. 0.05 s. The entry is called through ctypes, which releases the GIL (the kernels are
  nogil), so row ranges run on several threads at once.

An entry whose content does not match its SHA-256, or that needs a symbol this process cannot give it,
is not linked: the kernel is built again (and if that cannot be linked either, it runs as numba's own
dispatcher, the same compiled code, after numba's start).
"""
from __future__ import annotations

import builtins
import ctypes
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import re
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterable

import numpy as np

# argument kinds: every argument is a C-contiguous array, passed to the entry as (pointer, rows, columns);
# i8_2d, i32_1d and u16_1d are the grid i-quants' tables (quant/kernels/grids.py: grid, kmap, neighbours);
# u32_1d a count a kernel returns (the non-finite values it saw)
ARRAYS = {"f32_2d": (np.float32, 2), "f32_1d": (np.float32, 1), "u8_2d": (np.uint8, 2), "u8_1d": (np.uint8, 1),
          "u16_2d": (np.uint16, 2), "u16_1d": (np.uint16, 1), "u32_2d": (np.uint32, 2), "u32_1d": (np.uint32, 1),
          "i8_2d": (np.int8, 2),
          "i32_1d": (np.int32, 1)}
MAX_ARRAYS = 6      # x, qw, out and a grid type's three tables

# numba settings that change the code it generates (numba/core/config.py)
_NUMBA_ENV = ("NUMBA_OPT", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "NUMBA_ENABLE_AVX", "NUMBA_BOUNDSCHECK",
              "NUMBA_LOOP_VECTORIZE", "NUMBA_SLP_VECTORIZE")
CACHE_ENV = "KIMI_CONVERT_KERNEL_CACHE"     # a folder for the built entries (default: see cache_dir)
# RSS that loading kernels adds to a process (docs/performance.md, "Memory"): llvmlite's library, numba's
# helper extensions and the linked entries, 49.5-50.3 MiB measured; with numba imported to build an entry
# first (a cache miss), 122-125 MiB
NATIVE_RSS = 51 << 20
BUILD_RSS = 125 << 20


@functools.lru_cache(maxsize=None)
def _entry_type(n_arrays: int):
    """The C signature of an entry of ``n_arrays`` arrays: void (pointer, rows, columns) * n_arrays."""
    return ctypes.CFUNCTYPE(None, *([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * n_arrays))


class NativeError(RuntimeError):
    """A cached entry that cannot be linked (corrupt, or it needs a symbol this process lacks)."""


class Kernel:
    """The numba kernel ``name`` of ``module``, called with C-contiguous arrays of the given kinds.

    The first call loads it (built on a cache miss); later calls cost a ctypes call."""

    def __init__(self, module: str, name: str, *kinds: str):
        assert all(k in ARRAYS for k in kinds) and len(kinds) <= MAX_ARRAYS, kinds
        self.module, self.name, self.kinds = module, name, kinds
        self._entry = None
        self._native = _entry_type(len(kinds))     # what a linked entry is (else: numba's dispatcher)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Kernel({self.module}.{self.name}{self.kinds})"

    def __call__(self, *arrays: np.ndarray) -> None:
        if len(arrays) != len(self.kinds):
            raise TypeError(f"{self.name} takes {len(self.kinds)} arrays, got {len(arrays)}")
        for i, (a, kind) in enumerate(zip(arrays, self.kinds)):
            dtype, ndim = ARRAYS[kind]
            if a.dtype != dtype or a.ndim != ndim or not a.flags.c_contiguous:
                raise TypeError(f"{self.name}: argument {i} must be a C-contiguous {kind}, "
                                f"not {a.dtype}{list(a.shape)}{'' if a.flags.c_contiguous else ' (strided)'}")
        entry = self._entry or self.load()
        if not isinstance(entry, self._native):         # the dispatcher (see _load)
            entry(*arrays)
            return
        args: list = []
        for a in arrays:
            args += (a.ctypes.data, a.shape[0], a.shape[1] if a.ndim == 2 else 1)
        entry(*args)

    def load(self):
        """The entry (linked from the cache, built first on a miss), or numba's dispatcher if it cannot be."""
        with self._lock:
            if self._entry is None:
                self._entry = _load(self)
            return self._entry

    def python_function(self):
        """The numba dispatcher itself (imports numba)."""
        return getattr(importlib.import_module(self.module), self.name)


def load_rss(kernels: Iterable[Kernel]) -> int:
    """What loading ``kernels`` in a new process adds to its RSS: more if one has never been built here. (An
    entry of any key counts, so that this needs no llvmlite, 24 MiB, in a dry run; one of an older source is
    built again, and that one run peaks BUILD_RSS - NATIVE_RSS higher.)"""
    built = all(any(cache_dir(k.module).glob(f"{_stem(k)}.*.native")) for k in kernels)
    return NATIVE_RSS if built else BUILD_RSS


# --- the cache ---

def cache_dir(module: str) -> Path:
    """$KIMI_CONVERT_KERNEL_CACHE, else the __pycache__ beside the kernel's module (where numba caches it),
    else ~/.cache/kimi-convert (an installed, read-only package)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    here = Path(importlib.util.find_spec(module).origin).parent / "__pycache__"
    if _writable(here):
        return here
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kimi-convert"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def cache_key(k: Kernel) -> str:
    """What the entry's code depends on: the kernel's source, its kinds, this module, the compilers, the CPU."""
    h = hashlib.sha256(_source_digest(k.module) + _environment_digest())
    h.update(repr(k.kinds).encode())
    return h.hexdigest()[:20]


@functools.lru_cache(maxsize=None)
def _source_digest(module: str) -> bytes:
    """The kernel's module and the modules of its own package it imports (``from .common import ...``): numba
    inlines their functions into the entry's code."""
    path = Path(importlib.util.find_spec(module).origin)
    text = path.read_bytes()
    siblings = sorted(set(re.findall(rb"^from \.(\w+) import", text, re.MULTILINE)))
    h = hashlib.sha256(text)
    for name in siblings:
        h.update(hashlib.sha256((path.parent / f"{name.decode()}.py").read_bytes()).digest())
    return h.digest()


@functools.lru_cache(maxsize=None)
def _environment_digest() -> bytes:
    ll = _llvm()
    h = hashlib.sha256()
    for part in (Path(__file__).read_bytes(), _version_file("numba"), _version_file("llvmlite"),
                 sys.version.encode(), platform.machine().encode(),
                 ll.get_host_cpu_name().encode(), _host_features().encode(),
                 repr([(v, os.environ.get(v)) for v in _NUMBA_ENV]).encode()):
        h.update(hashlib.sha256(part).digest())
    return h.digest()


def _version_file(package: str) -> bytes:
    """The version record a package (numba, llvmlite: versioneer's ``_version.py``, its version and
    revision) ships, found without importing it. importlib.metadata would cost every start 14 ms here,
    and its import (email, socket, calendar) about as much again."""
    root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    return (root / "_version.py").read_bytes()


def cache_path(k: Kernel) -> Path:
    return cache_dir(k.module) / f"{_stem(k)}.{cache_key(k)}.native"


def _stem(k: Kernel) -> str:
    return f"{k.module.rsplit('.', 1)[-1]}.{k.name}"


def _read_entry(path: Path) -> tuple[dict, bytes] | None:
    """(header, object code) of a cached entry whose object matches its SHA-256, else None."""
    try:
        data = path.read_bytes()
        head, obj = data.split(b"\n", 1)
        header = json.loads(head)
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict) or header.get("sha256") != hashlib.sha256(obj).hexdigest():
        return None
    needs = header.get("needs")
    if not isinstance(header.get("symbol"), str) or not isinstance(needs, list) \
            or not all(isinstance(n, str) for n in needs):
        return None
    return header, obj


def _fits(k: Kernel, header: dict) -> bool:
    """Whether an entry's code takes ``k``'s arguments: as many (pointer, rows, columns) triples as kinds, of
    these kinds. (Before the grid tables every entry took three triples, whatever its kinds: native.py's bytes
    are in the key, so such an entry is never looked up, and a header without "arrays" is refused as well.)"""
    return header.get("kinds") == list(k.kinds) and header.get("arrays") == len(k.kinds)


def _write_entry(path: Path, header: dict, obj: bytes) -> None:
    """Atomically: a reader sees the whole entry or none (processes may build the same one at once)."""
    header = dict(header, sha256=hashlib.sha256(obj).hexdigest())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n" + obj)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load(k: Kernel):
    path = cache_path(k)
    entry = _read_entry(path)
    if entry is not None and _fits(k, entry[0]):
        try:
            return _link(k, *entry)
        except NativeError:
            pass                    # built again below
    try:
        header, obj = build(k)
        try:
            _write_entry(path, header, obj)
        except OSError:
            pass                    # a read-only cache: this process still links what it built
        return _link(k, header, obj)
    except NativeError as e:        # not buildable as an entry, or not linkable
        _fallbacks.append(f"{k.module}.{k.name}: {e}")
        return k.python_function()  # same code, through numba's dispatcher


# --- build: numba compiles the entry ---

def build(k: Kernel) -> tuple[dict, bytes]:
    """(header, object code) of the C entry of kernel ``k``, compiled by numba now."""
    from . import numba_start
    numba_start.start()
    from numba import carray, cfunc, types       # noqa: PLC0415  (numba only on a cache miss)

    params, views = [], []
    for i, kind in enumerate(k.kinds):
        params.append(f"p{i}, a{i}, b{i}")
        dtype, ndim = ARRAYS[kind]
        shape = f"(a{i}, b{i})" if ndim == 2 else f"(a{i},)"
        views.append(f"carray(p{i}, {shape}, np.{np.dtype(dtype).name})")
    # the entry's symbol is mangled from its module and name: unique per kernel, so entries built in
    # different processes never clash when one engine links them
    namespace = {"__name__": f"kimi_native.{k.module}", "kernel": k.python_function(), "carray": carray, "np": np}
    exec(f"def {k.name}({', '.join(params)}):\n    kernel({', '.join(views)})\n", namespace)    # noqa: S102
    sig = types.void(*([types.voidptr, types.int64, types.int64] * len(k.kinds)))
    entry = cfunc(sig, nogil=True, error_model="numpy")(namespace[k.name])
    library = entry._library
    if library.has_dynamic_globals:     # addresses of this process's objects baked in: not reusable
        raise NativeError(f"{k.name}: its code holds addresses of Python objects")
    _, _, (obj, _) = library.serialize_using_object_code()
    module = library._final_module
    needs = sorted(name for name in ({f.name for f in module.functions if f.is_declaration}
                                     | {g.name for g in module.global_variables if g.is_declaration})
                   if not name.startswith("llvm."))       # LLVM's intrinsics: compiled in, not linked
    return {"kernel": f"{k.module}.{k.name}", "kinds": list(k.kinds), "arrays": len(k.kinds),
            "symbol": entry.native_name, "needs": needs}, obj


# --- load: llvmlite links the object ---

_LINK_LOCK = threading.Lock()
_engine = None
_objects: list = []                 # kept alive with the engine
_fallbacks: list[str] = []          # kernels that run as numba dispatchers, and why (tests assert it is empty)


def _llvm():
    import llvmlite.binding as ll     # noqa: PLC0415  (a shared library, ~0.04 s; no numba)
    return ll


def _host_features() -> str:
    """This CPU's features, as numba reads them (numba's own settings are in the key: _NUMBA_ENV)."""
    try:
        return _llvm().get_host_cpu_features().flatten()
    except RuntimeError:
        return ""


def _link(k: Kernel, header: dict, obj: bytes):
    global _engine
    ll = _llvm()
    with _LINK_LOCK:
        if _engine is None:
            _engine = _new_engine(ll)
        missing = [s for s in header.get("needs", ()) if not ll.address_of_symbol(s)]
        if missing:     # MCJIT would abort the process on an unresolved symbol: refuse it here
            raise NativeError(f"{k.name}: needs {', '.join(missing)}")
        ref = ll.ObjectFileRef.from_data(obj)
        _objects.append(ref)
        _engine.add_object_file(ref)
        _engine.finalize_object()
        address = _engine.get_function_address(header["symbol"])
    if not address:
        raise NativeError(f"{k.name}: {header['symbol']} is not in its object code")
    return _entry_type(len(k.kinds))(address)


def _new_engine(ll):
    _register_numba_helpers(ll)
    ll.initialize_native_target()
    ll.initialize_native_asmprinter()
    target = ll.Target.from_triple(ll.get_process_triple())
    tm = target.create_target_machine(cpu=ll.get_host_cpu_name(), features=_host_features(), opt=3,
                                      reloc="static", codemodel="jitdefault", jit=True)
    return ll.create_mcjit_compiler(ll.parse_assembly(""), tm)


def _register_numba_helpers(ll) -> None:
    """The symbols numba gives LLVM when it starts (numba.core.base._load_global_helpers and
    numba.core.runtime.nrt): its C helpers, its runtime and the Python objects its code names."""
    numba_root = Path(importlib.util.find_spec("numba").submodule_search_locations[0])   # not imported
    for module in ("_helperlib", "_dynfunc"):
        for name, address in _extension(numba_root, f"numba.{module}").c_helpers.items():
            ll.add_symbol(f"numba_{name}", address)
    nrt = _extension(numba_root, "numba.core.runtime._nrt_python")
    for name, address in nrt.c_helpers.items():
        ll.add_symbol(name if name.startswith("_") else f"NRT_{name}", address)
    if "numba" not in sys.modules:          # numba's nrt.py does this when it is imported
        nrt.memsys_use_cpython_allocator()
    ll.add_symbol("_Py_NoneStruct", id(None))
    for obj in vars(builtins).values():
        if isinstance(obj, type) and issubclass(obj, BaseException):
            ll.add_symbol(f"PyExc_{obj.__name__}", id(obj))


def _extension(root: Path, name: str):
    """numba's extension module ``name`` loaded from its file, without importing the numba package (a module
    loaded twice from one file shares its C state: the same helpers and runtime as numba's own)."""
    if name in sys.modules:
        return sys.modules[name]
    stem = root.joinpath(*name.split(".")[1:])
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = stem.with_name(stem.name + suffix)
        if path.exists():
            loader = importlib.machinery.ExtensionFileLoader(name, str(path))
            spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return module
    raise NativeError(f"numba's {name} extension is not in {root}")

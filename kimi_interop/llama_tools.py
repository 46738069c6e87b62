"""The real ``llama-imatrix`` and ``llama-quantize`` command-line tools of the llama-cpp-python 0.3.36 tree (the
Oct-2026 llama.cpp, the same code as the native build of :mod:`kimi_interop.llama_cpp`), run as child processes.

``.ci/install-interop.sh`` (part 6) builds the two tools from that sdist's ``vendor/llama.cpp`` with the same pinned
ggml flags as the wheel (x86-64-v3, tinyBLAS, repack, OpenMP; static, CPU only), keeps them in a cache outside the
clone and copies them into ``<interop dir>/bin`` with a stamp (``llama-tools.stamp``: version, flags, hashes).

Both helpers raise :class:`InteropUnavailable` when the tools are not installed and :class:`InteropError` (with
the tail of the tool's output) when the tool fails. The child's environment is the caller's without the
``LLAMA_ARG_*`` variables, which llama.cpp's argument parser would read as options.
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ._common import INSTALL_HINT, InteropError, InteropUnavailable, interop_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TOOLS = ("llama-imatrix", "llama-quantize", "llama-perplexity")
STAMP = "llama-tools.stamp"
LOG_TRIES = 5


def tools_dir() -> Path:
    return interop_dir() / "bin"


def tools_available() -> str | None:
    """None if both tools of the pinned tree are installed (and run), else why not (with the install hint)."""
    d = tools_dir()
    missing = [t for t in TOOLS if not os.access(d / t, os.X_OK)]
    if missing:
        return f"{' and '.join(missing)} not installed in {d}: {INSTALL_HINT}"
    try:
        version = (d / STAMP).read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        version = None
    if version != LLAMA_CPP_PYTHON_VERSION:
        return (f"{d} holds llama.cpp tools of llama-cpp-python {version or '(no stamp)'}, need "
                f"{LLAMA_CPP_PYTHON_VERSION}: {INSTALL_HINT}")
    return None


def tool_path(name: str) -> Path:
    """The installed binary ``name`` (one of TOOLS); InteropUnavailable if the tools are not installed."""
    if name not in TOOLS:
        raise ValueError(f"{name!r} is not one of {TOOLS}")
    problem = tools_available()
    if problem is not None:
        raise InteropUnavailable(problem)
    return tools_dir() / name


def _env() -> dict[str, str]:
    # common_params_parse reads LLAMA_ARG_CTX_SIZE, LLAMA_ARG_BATCH, ... as options: a caller's must not leak in
    return {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}


def _tail(text: str, n: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _run(cmd: list[str], what: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=_env(),
                             timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise InteropError(f"{what} did not finish in {timeout:g} s: {' '.join(cmd)}") from e
    if res.returncode != 0:
        # llama-quantize prints its usage and some errors on stdout, llama.cpp's log goes to stderr
        out = _tail(res.stderr) or _tail(res.stdout)
        if res.stdout.strip() and res.stderr.strip():
            out += "\n--- stdout ---\n" + _tail(res.stdout, 10)
        raise InteropError(f"{what} failed (exit {res.returncode}): {' '.join(cmd)}\n{out}")
    return res


def llama_imatrix(
    model: Path,
    text_file: Path | None,
    out: Path,
    *,
    ctx: int,
    chunks: int | None = None,
    threads: int = 1,
    output_format: str = "gguf",
    in_files: Sequence[Path] = (),
    process_output: bool = False,
    batch: int | None = None,
    extra: Sequence[str] = (),
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """Run ``llama-imatrix -m MODEL -f TEXT_FILE -o OUT -c CTX -b BATCH -t THREADS ...`` on the CPU; returns the
    finished process (log on ``.stderr``, perplexities on ``.stdout``), raises InteropError with the log's tail if
    it fails or writes no OUT.

    ``batch`` defaults to ``ctx``: llama-imatrix evaluates ``batch // ctx`` chunks as parallel sequences of one
    batch (its own default ``-b 2048`` makes that 16 at ``ctx`` 128), so one chunk per decode (in ubatches of at
    most 512 tokens) is its plain behaviour. What the tool does with the text (llama.cpp's code, not ours):

    * it needs at least ``2 * ctx`` tokens, and takes ``min(chunks, n_tokens // ctx)`` chunks of ``ctx`` tokens;
    * each chunk's first token is replaced by BOS when the vocabulary adds one (not for our K3 files:
      ``tokenizer.ggml.add_bos_token`` false);
    * a matrix product with fewer than 16 token rows (a short last ubatch, ``-ub``) is not collected for the
      dense weights, while the experts' MUL_MAT_ID always is; ``imatrix.chunk_count`` is then derived from the
      collected counts (counts // ctx), not from the chunks evaluated;
    * it collects the ``blk.*`` matrix products (``output.weight`` too with ``process_output``).

    ``chunks`` None: all the text's chunks. ``in_files``: earlier imatrix files to combine with (``--in-file``);
    with ``text_file`` None they are only combined. ``extra``: more llama-imatrix options (``--no-ppl``,
    ``--parse-special``, ``--chunk N``, ``-ub N``, ...)."""
    if output_format not in ("gguf", "dat"):
        raise ValueError(f"output_format must be 'gguf' or 'dat', not {output_format!r}")
    # no -ngl: the build has no GPU backend (and warns that it ignores the option)
    cmd = [str(tool_path("llama-imatrix")), "-m", str(model), "-o", str(out), "-c", str(int(ctx)),
           "-b", str(int(batch if batch is not None else ctx)), "-t", str(int(threads)),
           "--output-format", output_format]
    if text_file is not None:
        cmd += ["-f", str(text_file)]
    if chunks is not None:
        cmd += ["--chunks", str(int(chunks))]
    for f in in_files:
        cmd += ["--in-file", str(f)]
    if process_output:
        cmd.append("--process-output")
    cmd += [str(a) for a in extra]
    Path(out).unlink(missing_ok=True)        # so that a stale file is never taken for this run's
    res = _run(cmd, "llama-imatrix", timeout)
    if not Path(out).is_file():
        raise InteropError(f"llama-imatrix exited 0 but wrote no {out}:\n{_tail(res.stderr)}")
    return res


def llama_quantize(
    src: Path,
    out: Path,
    ftype: str,
    *,
    imatrix: Path | None = None,
    threads: int = 1,
    allow_requantize: bool = False,
    extra: Sequence[str] = (),
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """Run ``llama-quantize [--allow-requantize] [EXTRA] [--imatrix IMATRIX] SRC OUT FTYPE THREADS``; returns the
    finished process (llama.cpp's per-tensor log on ``.stderr``), raises InteropError with the log's tail if it
    fails or writes no OUT. ``ftype`` is a name llama-quantize knows (Q4_K_M, IQ2_XXS, ...); ``extra`` are its
    options (``--pure``, ``--tensor-type PATTERN=TYPE``, ...), which must come before the file names.

    Our converted files keep the experts in MXFP4, which llama-quantize only requantizes with
    ``allow_requantize=True`` (else: "requantizing from type mxfp4 is disabled").

    (Not :func:`kimi_interop.llama_cpp.llama_quantize`, which calls the same library code in-process.)"""
    cmd = [str(tool_path("llama-quantize"))]
    if allow_requantize:
        cmd.append("--allow-requantize")
    cmd += [str(a) for a in extra]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    cmd += [str(src), str(out), str(ftype), str(int(threads))]
    Path(out).unlink(missing_ok=True)
    res = _run(cmd, "llama-quantize", timeout)
    if not Path(out).is_file():
        raise InteropError(f"llama-quantize exited 0 but wrote no {out}:\n{_tail(res.stderr)}")
    return res


def llama_perplexity(
    model: Path,
    base_file: Path,
    *,
    text_file: Path | None = None,
    ctx: int,
    chunks: int | None = None,
    threads: int = 1,
    batch: int | None = None,
    extra: Sequence[str] = (),
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """Run ``llama-perplexity`` on the CPU, in one of its two KL-divergence modes:

    * ``text_file`` given: ``-f TEXT --kl-divergence-base BASE_FILE`` writes the base file (MODEL is the base);
    * ``text_file`` None: ``--kl-divergence --kl-divergence-base BASE_FILE`` scores MODEL against it (the tokens
      come from the file) and prints the statistics on ``.stdout``.

    ``batch`` defaults to ``ctx`` (one chunk a decode; llama-perplexity's ``-b 2048`` would run ``2048 // ctx``
    chunks side by side). ``--no-repack`` always: on a CPU with AVX-512 the Oct-2026 build's CPU weight repacking
    aborts on a quantized K3 file (``GGML_ASSERT(*cur_backend_id != -1)``), and repacking does not change values.
    ``extra``: more llama-perplexity options (``-fa off``, ...).

    The statistics are printed by llama.cpp's logger thread, which the process does not wait for at exit (its
    singleton is leaked on purpose, common/log.cpp, llama.cpp issue 22142): measured here, about one run in
    three exits 0 with the last chunks and the summary missing from its output. Such a run is repeated (the
    computation is deterministic), up to LOG_TRIES times."""
    cmd = [str(tool_path("llama-perplexity")), "-m", str(model), "-c", str(int(ctx)),
           "-b", str(int(batch if batch is not None else ctx)), "-t", str(int(threads)), "--no-repack",
           "--kl-divergence-base", str(base_file)]
    if text_file is not None:
        cmd += ["-f", str(text_file)]
        Path(base_file).unlink(missing_ok=True)
    else:
        cmd.append("--kl-divergence")
    if chunks is not None:
        cmd += ["--chunks", str(int(chunks))]
    cmd += [str(a) for a in extra]
    for _ in range(LOG_TRIES):
        res = _run(cmd, "llama-perplexity", timeout)
        if text_file is not None or "Same top p:" in res.stdout:
            break
    if text_file is not None and not Path(base_file).is_file():
        raise InteropError(f"llama-perplexity exited 0 but wrote no {base_file}:\n{_tail(res.stderr)}")
    if text_file is None and "Same top p:" not in res.stdout:
        raise InteropError(f"llama-perplexity printed no KL divergence statistics in {LOG_TRIES} runs:\n"
                           f"{_tail(res.stdout)}")
    return res


def parse_kld_report(text: str) -> dict[str, float]:
    """The statistics llama-perplexity --kl-divergence prints (and kimi-verify kld prints under the same labels):
    label -> value, and label + " ±" -> its uncertainty where one is printed. Percent values stay in percent."""
    import re
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(Mean PPL\(Q\)/PPL\(base\)|Mean PPL\(Q\)-PPL\(base\)|Mean ln\(PPL\(Q\)/PPL\(base\)\)|"
                     r"Mean PPL\(Q\)|Mean PPL\(base\)|Cor\(ln\(PPL\(Q\)\), ln\(PPL\(base\)\)\)|"
                     r"[\w .%]+?KLD|[\w .%]+?Δp|RMS Δp|Same top p)\s*:\s*(-?[\d.]+)\s*%?(?:\s*±\s*(-?[\d.]+))?",
                     line.strip())
        if m:
            label = " ".join(m.group(1).split())
            out[label] = float(m.group(2))
            if m.group(3) is not None:
                out[label + " ±"] = float(m.group(3))
    return out

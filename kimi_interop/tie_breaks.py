"""Compare the runtime with llama.cpp at every weight matmul input, adopting llama.cpp's rounding at ties.

Both sides convert each weight matmul's f32 activation to the weight's vec_dot type (bf16, Q8_0, ...) and,
with `llama_cpp_rounding`, multiply in the same order (kimi_convert/runtime/ggml_cpu.py). Their f32 activations agree to
a few units in the last place; where such a value lies within that distance of a rounding boundary (9248
activations per position are rounded to bf16 in the BF16 fixtures, and every position has one within ~20
f32 ulps of a bf16 tie), the two sides round it to neighbouring bf16/Q8_0 values. That one-step difference is
then carried to every later position by the KDA state and the attention cache, so after the first such tie
break the logits of the two differ by a real amount although neither is wrong.

`LlamaCppTieBreaks` is a Runtime matmul hook that removes exactly those tie breaks. It holds llama.cpp's own
matmul inputs (kimi_interop.llama_cpp_trace) and, for every input the runtime is about to round:

* where the rounded values agree, it changes nothing;
* where they differ but the two f32 inputs agree to `rel_tol` of that row's largest magnitude, the runtime takes
  llama.cpp's f32 values for those elements (the element for bf16/f16, the whole block for Q8_0/Q8_K), so that
  both go on with the same rounded input; each case is recorded in `adopted`, as a "code" tie break (an element
  rounded to another code) or a "scale" one (the same codes, another block scale: Q8_K keeps 1/iscale in f32,
  so a last-bit difference of the block's largest element passes into every value of the block; Q8_1's block
  sum s = fp16(d * sum q) takes the unrounded d); with `adopt`
  restricted to some kinds, the others are only listed (`declined`);
* where they differ by more, nothing is adopted and the case is recorded in `mismatches` (a real difference).

Every matmul input of every position is checked, so the comparison can hold a tight bound at all positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from kimi_convert.runtime import ggml_cpu, ggml_cpu_quant
from kimi_convert.gguf_io import GGUFFile
from .llama_cpp_trace import LlamaCppTrace

F32 = np.float32


@dataclass
class TieBreak:
    """One input element (or block) rounded differently by the two sides."""
    position: int
    tensor: str           # GGUF tensor name, with the head or expert
    element: int          # the element (for a Q8_0/Q8_K block: its most different one)
    ours: float
    theirs: float
    rel_diff: float       # max |ours - theirs| / max |theirs| over that row
    kind: str = "code"    # "code": an element rounds to another code; "scale": same codes, another block scale

    def __str__(self) -> str:
        a, b = np.float32(self.ours), np.float32(self.theirs)
        return (f"position {self.position} {self.tensor}[{self.element}] ({self.kind}): {a!r} "
                f"(0x{int(a.view(np.uint32)):08x}) here, {b!r} (0x{int(b.view(np.uint32)):08x}) in llama.cpp, "
                f"row rel. diff {self.rel_diff:.1e}")


@dataclass
class LlamaCppTieBreaks:
    """Runtime matmul hook; see the module doc. target is the runtime's llama_cpp_rounding target."""
    gf: GGUFFile
    target: str
    trace: LlamaCppTrace
    rel_tol: float
    adopt: tuple[str, ...] = ("code", "scale")    # the kinds taken from llama.cpp; the others are only listed
    adopted: list[TieBreak] = field(default_factory=list)
    declined: list[TieBreak] = field(default_factory=list)
    mismatches: list[TieBreak] = field(default_factory=list)
    max_rel_diff: np.ndarray | None = None        # [T]: max over all rounded matmul inputs, per position
    checked: set[str] = field(default_factory=set)  # the tensors whose inputs were compared
    n_rounded: int = 0                            # activation elements compared

    def __call__(self, name: str, key, x: np.ndarray) -> np.ndarray:
        qtype = self.gf.tensors[name].qtype
        block = ggml_cpu.rounding_block_size(qtype, self.target)
        if block == 0:                            # F32 weights: nothing is rounded
            return x
        nodes = self.trace.inputs.get(name)
        if not nodes:
            raise ValueError(f"the runtime multiplies by {name}, llama.cpp does not")
        node = nodes[0]
        if isinstance(key, tuple):                # a routed expert's row: llama.cpp's x [T, 1 or n_used, K]
            t, e = key
            rows = node.x.reshape(node.ids.shape[0], -1, node.x.shape[-1])
            slots = np.flatnonzero(node.ids[t] == e)
            if not len(slots):
                raise ValueError(f"{name}: position {t} uses expert {e} here, not in llama.cpp "
                                 f"(llama.cpp's experts {sorted(node.ids[t].tolist())})")
            theirs, positions, label = rows[t, slots[0] if rows.shape[1] > 1 else 0][None], [t], f"{name} expert {e}"
        else:                                     # [T, K]; attn_k_b / attn_v_b: llama.cpp's [H, T, K], per head
            theirs = node.x.reshape(-1, *np.shape(x))[key]
            positions, label = list(range(len(theirs))), name + (f" head {key}" if key else "")
        ours = np.asarray(x, F32).reshape(theirs.shape)
        self.checked.add(name)
        self.n_rounded += ours.size
        out = self._reconcile(ours, theirs, qtype, block, positions, label)
        return out.reshape(np.shape(x))

    def _reconcile(self, ours, theirs, qtype, block, positions, label) -> np.ndarray:
        n_tok, k = ours.shape
        scale = np.maximum(np.abs(theirs).max(-1), F32(1e-30))                       # [T]
        rel = (np.abs(ours - theirs).max(-1) / scale).astype(np.float64)
        self._note(positions, rel)
        same = ggml_cpu.same_conversion(ours, theirs, qtype, self.target)
        if same.all():
            return ours
        codes_ours, codes_theirs = _codes(ours, qtype, self.target, block), _codes(theirs, qtype, self.target, block)
        out = ours.copy()
        blocks = (~same).reshape(n_tok, k // block, block).any(-1)                    # [T, nb]
        for t, b in zip(*np.nonzero(blocks)):
            sl = slice(b * block, (b + 1) * block)
            j = b * block + int(np.argmax(np.abs(ours[t, sl] - theirs[t, sl])))     # the most different element
            kind = "scale" if block > 1 and np.array_equal(codes_ours[t, b], codes_theirs[t, b]) else "code"
            tie = TieBreak(positions[t], label, j, float(ours[t, j]), float(theirs[t, j]), float(rel[t]), kind)
            if rel[t] > self.rel_tol:
                self.mismatches.append(tie)
            elif kind in self.adopt:
                out[t, sl] = theirs[t, sl]
                self.adopted.append(tie)
            else:
                self.declined.append(tie)
        return out

    def count(self, kind: str) -> int:
        return sum(t.kind == kind for t in self.adopted)

    def _note(self, positions, rel) -> None:
        if self.max_rel_diff is None:
            self.max_rel_diff = np.zeros(self.trace.logits.shape[0])
        np.maximum.at(self.max_rel_diff, positions, rel)


def _codes(x: np.ndarray, qtype, target: str, block: int) -> np.ndarray:
    """[T, n_blocks, block] the integer codes of x's vec_dot conversion (the values themselves for bf16/f16)."""
    if block == 1:
        return ggml_cpu.vec_dot_input(x, qtype, target)[..., None]
    if block == ggml_cpu.Q8_0_BLOCK:
        return ggml_cpu.quantize_q8_0(x, target)[0]
    return ggml_cpu_quant.quantize_q8_k(x)[0]

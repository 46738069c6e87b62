"""The structure part: the file(s) parse, and tensor data is aligned, inside the file and packed in order."""
from __future__ import annotations

from pathlib import Path

from ..errors import KimiError
from ..gguf_io import gguf_parts, read_gguf
from .report import Part

# ------------------------------------------------------------------------------------
# part: structure

def check_structure(part: Part, path: Path) -> Part:
    try:
        parts = gguf_parts(path)
    except KimiError as e:
        part.fail(str(e))
        return part.finish("a split part is missing")
    n_tensors, unreadable = 0, 0
    for p in parts:
        try:
            r = read_gguf(p)        # checks alignment, sizes, bounds and packing; names the first fault
        except KimiError as e:
            part.fail(str(e))
            unreadable += 1
            continue
        (layout,) = r.parts
        n_tensors += layout.n_tensors
        part.rows.append({"file": p.name, "bytes": layout.size, "tensors": layout.n_tensors,
                          "alignment": layout.alignment, "gguf_version": layout.version,
                          "data_offset": layout.data_offset})
        if len(parts) > 1:
            no = r.fields.get("split.no")
            if not isinstance(no, int) or no != parts.index(p):
                part.fail(f"{p.name}: split.no is missing or not {parts.index(p)}")
    part.figures = {"files": len(parts), "tensors": n_tensors, "unreadable": unreadable}
    if unreadable:
        return part.finish("not a readable GGUF file" if len(parts) == 1
                           else f"{unreadable} of {len(parts)} files are not readable GGUF files")
    verdict = "offsets aligned and in bounds" if not part.failures else "see the failures"
    return part.finish(f"{len(parts)} file(s), {n_tensors} tensors, {verdict}")

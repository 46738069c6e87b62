"""The manifest's tensor digest: SHA-256 over the SHA-256 of each LEAF bytes, so that every core can hash.

One SHA-256 over a tensor is one core's work whatever the machine: 1.3 GB/s here (SHA-NI), so a writer that
hashes each tensor in one stream stays near that rate on a 32-core workstation with a 7 GB/s disk. A tensor's
digest is instead

    sha256( sha256(b[0:L]) || sha256(b[L:2L]) || ... )        L = LEAF = 1 MiB, the last leaf shorter

(sha256(b"") for an empty tensor: no leaves). The leaves of a buffer are hashed side by side on a pool of
threads (hashlib lets go of the GIL on large buffers), in the writer's sink and in `kimi-verify check`; any
tool recomputes it with a few lines of hashlib (docs/formats.md). Manifests written before it say "hash":
"sha256" (one stream) and are still checked that way.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Iterable

LEAF = 1 << 20
TREE = "sha256-tree-1MiB"       # the manifest's "hash" for this digest
FLAT = "sha256"                 # ... and for one SHA-256 over the bytes (manifests of earlier versions)
SCHEMES = (TREE, FLAT)


@lru_cache(maxsize=None)
def hash_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, threads), thread_name_prefix="kimi-hash")


class TreeDigest:
    """hashlib's update/hexdigest for the tree digest; each update's leaves are hashed on `threads` threads
    at once. Updates must come in stream order, and each is finished when it returns."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, threads)
        self.leaves: list[bytes] = []           # the finished leaves' digests
        self.open = hashlib.sha256()            # the leaf being filled
        self.filled = 0                         # ... and its bytes so far

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        pieces, finished, at = [], [], 0
        leaf, filled = self.open, self.filled
        while at < len(view):
            n = min(LEAF - filled, len(view) - at)
            pieces.append((leaf, view[at:at + n]))
            at, filled = at + n, filled + n
            if filled == LEAF:
                finished.append(leaf)
                leaf, filled = hashlib.sha256(), 0
        if len(pieces) > 1 and self.threads > 1:
            list(hash_pool(self.threads).map(_update, pieces))
        else:
            for piece in pieces:
                _update(piece)
        self.leaves += [h.digest() for h in finished]
        self.open, self.filled = leaf, filled

    def digest(self) -> bytes:
        leaves = self.leaves + ([self.open.digest()] if self.filled else [])
        return hashlib.sha256(b"".join(leaves)).digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


def _update(piece) -> None:
    h, part = piece
    h.update(part)


def new_digest(scheme: str, threads: int = 1):
    """An empty digest of the manifest's `scheme` (SCHEMES)."""
    return TreeDigest(threads) if scheme == TREE else hashlib.sha256()


def tree_sha256(parts: Iterable[bytes]) -> str:
    """The tree digest of the concatenated `parts`, on one thread (the reference the tests hold the writer to)."""
    d = TreeDigest(1)
    for p in parts:
        d.update(p)
    return d.hexdigest()

"""Chained hashes of full KV blocks: a block's hash covers its tokens and every token before it.

hash(block i) = sha256(hash(block i - 1) | its token ids | extra keys), with the
first block's parent a fixed value. A request's `cache_salt` is the first block's
extra key, so through the chain it separates every block of requests salted apart
(vLLM's cache_salt: tenants that must not observe each other's cache timing). Two
requests share a block's KV exactly when their hashes agree, i.e. when their token
sequences (and salts) agree up to that block's end.
SHA-256 (as vLLM's default) makes a collision, which would serve one request
another's KV, practically impossible. Hashes are computed once per block, as its
tokens become known.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_ROOT = b"\x00" * 32


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    h = hashlib.sha256(parent or _ROOT)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra_keys)
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        num_tokens: int | None = None, salt: bytes = b"") -> list[bytes]:
    """Append to `hashes` the hashes of the full blocks among the first `num_tokens` (default: all)
    of `token_ids` not hashed yet, `salt` keying the first; returns `hashes`."""
    n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    for i in range(len(hashes), n // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size],
                                 b"" if i else salt))
    return hashes

"""On-disk cache of GGUF files converted to HF checkpoints, keyed by content hash.

Layout under `cache_root()`:
    converted/<sha256[:16]>/   one HF checkpoint folder per distinct GGUF content, with
                               its quantized tensors in QUANT_FILE
    hash_index.json            realpath -> (size, mtime_ns, sha256), so a warm start
                               need not rehash the file; a changed file misses it
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from mrv2.loader.errors import ModelLoadError

logger = logging.getLogger("mrv2")

_HASH_CHUNK = 16 << 20
# The quantized tensors of a converted GGUF (codes and scales; see mrv2.loader.gguf_quant), in
# a subfolder: tools that load every *.safetensors of a checkpoint folder (vLLM) must not see it.
# Its name changes with the set of types kept (v2: Q4_K added; v3: Q6_K), so older folders get a new one.
QUANT_FILE = "quantized/gguf_blocks-v3.safetensors"


def cache_root() -> Path:
    """`$MRV2_CACHE_DIR`, else `$XDG_CACHE_HOME/mrv2`, else `~/.cache/mrv2`."""
    if explicit := os.environ.get("MRV2_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mrv2"


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's content, read in large chunks."""
    digest, buf = hashlib.sha256(), bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def content_hash(path: str | os.PathLike) -> str:
    """sha256 of `path`, memoized in the cache's side index by (realpath, size, mtime_ns)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = [st.st_size, st.st_mtime_ns]
    index_path = cache_root() / "hash_index.json"
    try:
        index = dict(json.loads(index_path.read_text()))
    except (OSError, ValueError, TypeError):
        index = {}
    entry = index.get(real)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry["sha256"]
    sha = file_sha256(real)
    index[real] = {"stamp": stamp, "sha256": sha}
    with contextlib.suppress(OSError):  # only a speed-up; a read-only cache must still work
        _write_atomic(index_path, json.dumps(index, indent=1))
    return sha


def converted_checkpoint(gguf_path: str | os.PathLike) -> Path:
    """HF checkpoint folder for a GGUF file, converting it on first use."""
    dest = cache_root() / "converted" / content_hash(gguf_path)[:16]
    # Conversions land by atomic rename, so a folder with a config.json is complete
    # (folders converted before the quantized weights were kept get them now).
    if (dest / "config.json").is_file():
        if not (dest / QUANT_FILE).is_file():
            from mrv2.loader.gguf_convert import ensure_quantized_weights

            ensure_quantized_weights(gguf_path, dest)
        return dest
    from mrv2.loader.gguf_convert import convert_gguf_to_hf

    logger.info("converting %s to an HF checkpoint in %s (first use; cached afterwards)", gguf_path, dest)
    try:
        convert_gguf_to_hf(gguf_path, dest)
    except FileExistsError:
        if not (dest / "config.json").is_file():
            raise ModelLoadError(f"cache folder {dest} is incomplete; delete it and retry") from None
    return dest


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

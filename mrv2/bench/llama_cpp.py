"""llama.cpp as a benchmark peer, through `llama-cpp-python` (the optional `llama` extra).

The same workload as `mrv2 bench throughput`: every prompt is its own sequence of one
llama.cpp context, all prompts are prefilled in one `llama_decode` call (llama.cpp
splits it into micro-batches), then each step decodes one greedy token per sequence,
like `llama-batched-bench`. It runs on the GGUF file itself (the embedded default
model's Q4_1 blocks as they are), with the threads mrv2 uses.
"""

from __future__ import annotations

import ctypes
import importlib.util
import time
from pathlib import Path

import numpy as np

MISSING = ("llama.cpp comparison skipped: llama-cpp-python is not installed "
           "(pip install 'mrv2[llama]', which builds llama.cpp for this CPU)")


def available() -> bool:
    """Whether `llama_cpp` (llama-cpp-python) can be imported."""
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppPeer:
    """One loaded GGUF model; `generate` runs a greedy batch workload on a fresh context."""

    def __init__(self, gguf: Path, threads: int) -> None:
        import llama_cpp

        self._ll = llama_cpp
        llama_cpp.llama_backend_init()
        _silence(llama_cpp)
        params = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.threads = threads
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model))

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        """(seconds, greedy output ids per prompt); context set-up is not timed."""
        ll, b = self._ll, len(prompts)
        total = sum(len(p) for p in prompts)
        params = ll.llama_context_default_params()
        params.n_seq_max = b
        params.n_ctx = b * (max(len(p) for p in prompts) + output_len + 16)
        params.n_batch = max(total, b)
        params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = self.threads
        ctx = ll.llama_init_from_model(self._model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context for this workload")
        batch = ll.llama_batch_init(params.n_batch, 0, 1)
        try:
            t0 = time.perf_counter()
            n = 0
            for s, prompt in enumerate(prompts):
                for i, tok in enumerate(prompt):
                    self._put(batch, n, tok, i, s, i == len(prompt) - 1)
                    n += 1
            outputs: list[list[int]] = [[] for _ in prompts]
            positions = [len(p) for p in prompts]
            for step in range(output_len):
                batch.n_tokens = n
                if ll.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                logits = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(b, self.n_vocab))
                ids = logits.argmax(axis=1).tolist()
                for s, tok in enumerate(ids):
                    outputs[s].append(tok)
                if step == output_len - 1:
                    break
                for s, tok in enumerate(ids):
                    self._put(batch, s, tok, positions[s], s, True)
                    positions[s] += 1
                n = b
            return time.perf_counter() - t0, outputs
        finally:
            ll.llama_batch_free(batch)
            ll.llama_free(ctx)

    @staticmethod
    def _put(batch, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    def close(self) -> None:
        """Free the model."""
        if self._model:
            self._ll.llama_model_free(self._model)
            self._model = None


_log_callback = None  # the ctypes callback must outlive every llama.cpp call that may log


def _silence(llama_cpp) -> None:
    """Keep llama.cpp's logging out of the benchmark's output."""
    global _log_callback
    if _log_callback is None:
        _log_callback = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p())

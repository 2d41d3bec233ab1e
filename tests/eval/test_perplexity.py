"""Perplexity against transformers on the same weights (fp32), and the CLI."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest
import torch

from mrv2 import LLM
from mrv2.eval import perplexity

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 +
        "In 1969, astronauts landed on the Moon and walked on its surface for the first time. " * 2)


def _hf_nll(hf, ids: list[int], window: int, stride: int) -> tuple[int, float]:
    """The same sliding windows through transformers: (tokens scored, mean nll)."""
    total, count, scored_to, start = 0.0, 0, 1, 0
    with torch.no_grad():
        while scored_to < len(ids):
            end = min(start + window, len(ids))
            logits = hf(torch.tensor([ids[start:end]])).logits[0, :-1].float()
            lp = logits.log_softmax(-1).gather(1, torch.tensor(ids[start + 1:end])[:, None])[:, 0]
            new = lp[scored_to - start - 1:]
            total -= float(new.double().sum())
            count += new.numel()
            scored_to = end
            start = max(0, min(start + stride, end - 1))
    return count, total / count


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("window,stride", [(1024, None), (16, 8), (12, 11)])
def test_perplexity_matches_transformers(tiny_checkpoint, arch, window, stride):
    path, hf = tiny_checkpoint(arch, False)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=1 << 22)
    ids = [(31 * i + 7 * (i // 5)) % 509 + 3 for i in range(40)]  # the tiny vocabulary has 512 tokens
    result = perplexity(llm, ids, window, stride)
    count, nll = _hf_nll(hf, ids, min(window, llm.engine.config.max_model_len), stride or min(window, 512) // 2)
    assert result.num_tokens == count == len(ids) - 1  # every token after the first, once
    assert result.nll == pytest.approx(nll, rel=1e-4)
    assert result.perplexity == pytest.approx(math.exp(nll), rel=1e-4)


def test_bad_inputs_name_the_problem(default_llm):
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(default_llm, "")
    with pytest.raises(ValueError, match="stride"):
        perplexity(default_llm, TEXT, window=8, stride=8)


def test_cli_perplexity_on_the_default_model(tmp_path, default_llm):
    src = tmp_path / "text.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "ppl.json"
    r = subprocess.run([shutil.which("mrv2"), "eval", "perplexity", "--file", str(src), "--json", str(out),
                        "--dtype", "float32", "--max-model-len", "256"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    expected = perplexity(default_llm, TEXT)
    assert result["tokens"] == expected.num_tokens and result["perplexity"] == pytest.approx(expected.perplexity, rel=1e-4)
    assert "perplexity" in r.stdout
    missing = subprocess.run([shutil.which("mrv2"), "eval", "perplexity", "--file", str(tmp_path / "nope.txt")],
                             capture_output=True, text=True, timeout=600)
    assert missing.returncode == 2 and "nope.txt" in missing.stderr

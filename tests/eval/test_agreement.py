"""Greedy agreement with a float32 reference: prompts from a text, the API and the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mrv2 import LLM
from mrv2.eval import greedy_agreement
from mrv2.eval.agreement import text_prompts

TEXT = ("The quick brown fox jumps over the lazy dog. In 1969, astronauts landed on the Moon and walked on its "
        "surface for the first time. Rivers carry water from the mountains to the sea, shaping valleys as they go.")


def test_prompts_are_evenly_spaced_windows_of_the_text():
    ids = list(range(100))
    prompts = text_prompts(ids, 4, 10)
    assert prompts == [ids[0:10], ids[30:40], ids[60:70], ids[90:100]]
    assert text_prompts(ids, 1, 100) == [ids]
    with pytest.raises(ValueError, match="fewer than one prompt"):
        text_prompts(ids[:5], 2, 10)
    with pytest.raises(ValueError, match="num_prompts >= 1"):
        text_prompts(ids, 0, 10)


def test_an_engine_agrees_with_itself(default_llm):
    r = greedy_agreement(default_llm, default_llm, TEXT, num_prompts=4, prompt_len=8, max_tokens=8)
    assert (r.num_prompts, r.identical, r.prefix_share) == (4, 4, 1.0)


def test_quantized_engine_against_fp32_is_consistent(default_llm):
    int4 = LLM(dtype="bfloat16", quantization="gguf", max_model_len=256, kv_cache_memory=16 << 20)
    r = greedy_agreement(int4, default_llm, TEXT, num_prompts=6, prompt_len=8, max_tokens=12)
    assert 0 <= r.identical <= 6 and r.identical / 6 <= r.prefix_share <= 1
    assert (r.prefix_share == 1) == (r.identical == 6)
    assert int4.engine.scheduler.block_pool.is_whole()


def test_cli_float32_engine_is_identical_to_its_reference(tmp_path: Path):
    mrv2 = shutil.which("mrv2", path=str(Path(sys.executable).parent)) or "mrv2"
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "a.json"
    r = subprocess.run([mrv2, "eval", "agreement", "--file", str(text), "--num-prompts", "3", "--prompt-len", "8",
                        "--max-tokens", "6", "--dtype", "float32", "--max-model-len", "128", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "identical completions 3/3" in r.stdout
    record = json.loads(out.read_text())
    assert record["identical"] == 3 and record["prefix_share"] == 1.0 and record["dtype"] == "float32"
    missing = subprocess.run([mrv2, "eval", "agreement", "--file", str(tmp_path / "nope.txt")],
                             capture_output=True, text=True, timeout=600)
    assert missing.returncode != 0 and "nope.txt" in missing.stderr

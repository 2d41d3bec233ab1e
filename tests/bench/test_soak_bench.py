"""`mrv2 bench soak`: a short soak ends every request once and gets every block back."""

from __future__ import annotations

import json

import pytest

from mrv2.entrypoints.cli import main


def test_a_short_soak_under_a_small_cache_leaks_nothing(tmp_path, capsys):
    out = tmp_path / "soak.json"
    code = main(["bench", "soak", "--requests", "60", "--warmup", "10", "--concurrency", "8", "--abort-fraction",
                 "0.3", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", str(12 * 737280 + (1 << 16)),
                 "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["problems"] == []
    assert result["aborted"] > 0 and result["preemptions"] > 0 and result["prefix_hit_rate"] > 0
    assert result["blocks_free"] == result["blocks_usable"] and len(result["rss_samples"]) >= 2
    assert "KV blocks free at the end" in capsys.readouterr().out


@pytest.mark.parametrize("flags,name", [(["--prompt-len", "5"], "--prompt-len"), (["--output-len", "3,1"], "--output-len"),
                                        (["--warmup", "10", "--requests", "5"], "--warmup")])
def test_bad_options_name_the_option(flags, name, capsys):
    assert main(["bench", "soak", *flags]) != 0
    assert name in capsys.readouterr().err

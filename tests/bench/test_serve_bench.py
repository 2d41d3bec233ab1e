"""`mrv2 bench serve`: latency statistics, and a whole run against a server it starts itself."""

from __future__ import annotations

import json

import pytest

from mrv2.bench.serve import RequestResult, _engine_argv, summarize
from mrv2.entrypoints.cli import build_parser, main


def test_summarize_percentiles_and_failures():
    ok = [RequestResult(0.0, [0.1, 0.2, 0.4], output_tokens=3), RequestResult(1.0, [1.3, 1.4, 1.5], output_tokens=3)]
    failed = RequestResult(0.0, error="APIError: boom")
    s = summarize(ok + [failed], wall=2.0)
    assert s["requests"] == 3 and s["failed"] == 1 and s["errors"] == ["APIError: boom"]
    assert s["request_throughput"] == pytest.approx(1.0) and s["output_tok_s"] == pytest.approx(3.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)  # TTFTs 100 and 300 ms
    assert s["tpot_ms"]["mean"] == pytest.approx(125.0)  # (0.3 / 2 + 0.2 / 2) / 2
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)  # 100, 200, 100, 100 ms


def test_engine_options_reach_the_server_it_starts():
    args = build_parser().parse_args(["bench", "serve", "--dtype", "float32", "--max-model-len", "256",
                                      "--no-async-scheduling", "--enforce-eager", "--graph-capture-sizes", "1,2",
                                      "--batch-invariant", "--speculative-config", '{"method": "ngram"}'])
    argv = _engine_argv(args)
    for expected in (["--dtype", "float32"], ["--max-model-len", "256"], ["--no-async-scheduling"],
                     ["--enforce-eager"], ["--graph-capture-sizes", "1,2"], ["--batch-invariant"],
                     ["--speculative-config", '{"method": "ngram"}']):
        i = argv.index(expected[0])
        assert argv[i:i + len(expected)] == expected
    served = build_parser().parse_args(["serve", *argv])
    assert served.async_scheduling is False and served.batch_invariant is True
    assert served.speculative_config == {"method": "ngram"}


def test_a_whole_run_writes_json_and_a_plot(tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    code = main(["bench", "serve", "--concurrency", "1,2", "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "4", "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory",
                 str(8 << 20), "--json", str(out), "--plot", str(png)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["levels"]) == {"1", "2"}
    for level in result["levels"].values():
        assert level["requests"] == 3 and level["failed"] == 0
        assert level["output_tok_s"] > 0 and level["ttft_ms"]["p99"] >= level["ttft_ms"]["p50"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


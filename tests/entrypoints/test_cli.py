"""The `mrv2` console script, run as a user would (a real subprocess each time)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

MRV2 = shutil.which("mrv2", path=os.path.dirname(sys.executable)) or "mrv2"


def run(*args: str, input: str | None = None, exact: bool = True, eager: bool = True) -> subprocess.CompletedProcess:
    """Run the `mrv2` command; in the exact fp32 reference mode unless `exact` is False or a dtype is given.

    `generate` and `chat` run eagerly (each process would compile its decode graph, some 8 s) unless `eager`
    is False or graph options are given: these tests are about the command's options, the graphs' tokens
    are tested in tests/runner and below with the default settings."""
    command = next((a for a in args if a in ("generate", "chat", "bench")), None)  # past global options
    if exact and command is not None and "--dtype" not in args:
        args = (*args, "--dtype", "float32")
    if eager and command in ("generate", "chat") and not any(a.startswith("--graph") for a in args):
        args = (*args, "--enforce-eager")
    return subprocess.run([MRV2, *args], input=input, capture_output=True, text=True, timeout=600)


def test_generate_prints_the_completion(default_llm):
    # The default settings: a decode of one request replays the compiled graph.
    r = run("generate", "The capital of France is", "--max-tokens", "8", "--max-model-len", "512", eager=False)
    assert r.returncode == 0, r.stderr
    expected = default_llm.generate("The capital of France is", _greedy(8))[0].outputs[0].text
    assert r.stdout.strip() == expected.strip()


def test_generate_with_stop_strings_and_penalties(default_llm):
    from mrv2 import SamplingParams

    args = ("generate", "The capital of France is", "--max-tokens", "24", "--max-model-len", "512", "--stop", "answer",
            "--stop", "United", "--repetition-penalty", "1.2", "--presence-penalty", "0.5")
    r = run(*args)
    assert r.returncode == 0, r.stderr
    params = SamplingParams(temperature=0, max_tokens=24, stop=["answer", "United"], repetition_penalty=1.2,
                            presence_penalty=0.5)
    expected = default_llm.generate("The capital of France is", params)[0].outputs[0]
    assert r.stdout.strip() == expected.text.strip() and expected.finish_reason == "stop"


@pytest.mark.parametrize("mode, extra", [("full", []), ("piecewise", ["--no-graph-compile"])])
def test_generate_with_graph_mode(default_llm, mode, extra):
    # Compiled pieces are tested in tests/runner and tests/engine; here the options' way through the CLI.
    r = run("generate", "The capital of France is", "--max-tokens", "8", "--max-model-len", "512",
            "--graph-mode", mode, "--graph-capture-sizes", "1,2,4,8", *extra)
    assert r.returncode == 0, r.stderr
    expected = default_llm.generate("The capital of France is", _greedy(8))[0].outputs[0].text
    assert r.stdout.strip() == expected.strip()


def test_generate_chat(default_llm):
    r = run("generate", "What is the capital of France?", "--chat", "--max-tokens", "16", "--max-model-len", "512")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_from_file_writes_jsonl(tmp_path: Path, default_llm):
    src = tmp_path / "prompts.txt"
    src.write_text("The capital of France is\n\n" + json.dumps({"prompt": "1, 2, 3,"}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "Say hi"}]}) + "\n")
    dst = tmp_path / "out.jsonl"
    r = run("generate", "--input", str(src), "--output", str(dst), "--max-tokens", "6", "--max-model-len", "512")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [row["prompt"] for row in rows[:2]] == ["The capital of France is", "1, 2, 3,"]
    assert rows[2]["prompt"] == [{"role": "user", "content": "Say hi"}]
    assert all(len(row["token_ids"]) <= 6 and row["finish_reason"] in ("stop", "length") for row in rows)
    expected = default_llm.generate("1, 2, 3,", _greedy(6))[0].outputs[0]
    assert rows[1]["token_ids"] == expected.token_ids and rows[1]["text"] == expected.text
    assert "Processed prompts" in r.stderr  # the progress bar


def test_chat_session_keeps_history():
    r = run("chat", "--max-tokens", "12", "--max-model-len", "512",
            input="My name is Ada. Please remember it.\nWhat is my name?\n/exit\n")
    assert r.returncode == 0, r.stderr
    replies = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(replies) >= 2
    assert "Ada" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["generate", "hi", "--model", "/no/such/model"], "/no/such/model"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--presence-penalty", "5"], "presence_penalty"),
    (["generate"], "prompt"),
    (["generate", "hi", "--graph-capture-sizes", "1,x"], "--graph-capture-sizes"),
    (["generate", "hi", "--graph-capture-sizes", "0"], "capture_sizes"),
])
def test_bad_arguments_exit_2_with_a_clear_message(args, needle):
    r = run(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_input_file_line_is_named(tmp_path: Path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "ok"}\n{"oops": 1}\n')
    r = run("generate", "--input", str(src))
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr


def test_bench_throughput_compare_hf(tmp_path: Path):
    out = tmp_path / "bench.json"
    r = run("bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "8", "--compare", "hf",
            "--json", str(out), "--max-model-len", "512", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "output tok/s" in r.stdout and "ratio mrv2/hf" in r.stdout and "host waits for the device" in r.stdout
    assert "| 4 |" in r.stdout  # the summary table
    result = json.loads(out.read_text())["results"]["4"]
    assert result["hf"]["identical_completions"] == 4  # greedy, fp32: the same tokens as transformers
    assert result["mrv2"]["output_tok_s"] > 0 and result["hf"]["output_tok_s"] > 0


def test_bench_throughput_compare_llama_cpp_and_vllm_with_plot(tmp_path: Path):
    """llama.cpp on the same GGUF when llama-cpp-python is installed, vLLM in its own environment when one is
    named ($MRV2_VLLM_PYTHON); a clear skip message for each otherwise."""
    from mrv2.bench import llama_cpp, vllm_peer

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    r = run("bench", "throughput", "--batch-sizes", "1,3", "--input-len", "8", "--output-len", "6", "--compare",
            "llama.cpp,vllm", "--repeat", "2", "--json", str(out), "--plot", str(png), "--max-model-len", "256",
            "--enforce-eager", exact=False)
    assert r.returncode == 0, r.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"1", "3"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name, present, missing in (("llama.cpp", llama_cpp.available(), llama_cpp.MISSING),
                                   ("vllm", vllm_peer.find_python(None) is not None, vllm_peer.MISSING)):
        if present:
            for b, res in results.items():
                assert res[name]["output_tok_s"] > 0 and 0 <= res[name]["identical_completions"] <= int(b)
                assert len(res[name]["pair_ratios"]) == 2  # timed in turns with mrv2
            assert f"mrv2/{name}" in r.stdout
        else:
            assert missing in r.stdout
            assert all(name not in res for res in results.values())


@pytest.mark.parametrize("compare, problem", [("sglang", "unknown engine 'sglang'"),
                                              ("async,hf", "does not combine"),
                                              ("vllm --vllm-python /no/such/python", "/no/such/python is not a file")])
def test_bench_throughput_rejects_bad_compare(compare, problem):
    r = run("bench", "throughput", "--num-prompts", "1", "--compare", *compare.split())
    assert r.returncode != 0 and problem in r.stderr


def test_bench_throughput_compares_async_on_and_off(tmp_path: Path):
    out = tmp_path / "bench.json"
    r = run("bench", "throughput", "--batch-sizes", "3", "--input-len", "8", "--output-len", "6", "--compare",
            "async", "--repeat", "2", "--json", str(out), "--max-model-len", "256", "--dtype", "float32", "--enforce-eager")
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())["results"]
    assert set(result) == {"3"}
    for b, res in result.items():
        assert res["identical_completions"] == int(b)
        assert res["ratio_async_over_serial"] == pytest.approx(float(np.median(res["pair_ratios"])))
        for side in ("async", "serial"):
            assert res[side]["output_tok_s"] > 0 and 0 < res[side]["host_wait_share"] <= 1
    assert r.stdout.count("ratio async/serial") == 1


def test_bench_throughput_async_engine_process_reports_bad_model():
    r = run("bench", "throughput", "--num-prompts", "1", "--compare", "async", "--model", "/no/such/model")
    assert r.returncode != 0 and "model not found: /no/such/model" in r.stderr


def test_bench_decode_times_every_mode_side_by_side():
    r = run("bench", "decode", "--batch-sizes", "1,2", "--steps", "2", "--context", "8")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("batch")]
    assert len(lines) == 2
    for line in lines:
        assert "full/eager" in line and "piecewise/eager" in line and "piecewise-eager/eager" in line


def _greedy(n: int):
    from mrv2 import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


def test_default_dtype_is_logged_with_its_reason():
    r = run("--log-level", "INFO", "generate", "Hello", "--max-tokens", "2", "--max-model-len", "128", exact=False)
    assert r.returncode == 0, r.stderr
    assert "Running in" in r.stderr and "dtype='auto'" in r.stderr


def test_bench_latency_reports_ttft_and_tpot(tmp_path: Path):
    out = tmp_path / "lat.json"
    r = run("bench", "latency", "--input-len", "8", "--output-len", "5", "--repeat", "2", "--json", str(out),
            "--max-model-len", "128")
    assert r.returncode == 0, r.stderr
    assert "time to first token" in r.stdout and "time per output token" in r.stdout
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 2 and result["ttft_s"] > 0 and result["tpot_s"] > 0


@pytest.mark.parametrize("pair, first, second", [("tp", "tp2", "tp1"), ("attention", "cpp-paged", "inductor-paged"),
                                                    ("graphs", "graphs", "eager")])
def test_bench_throughput_compares_mrv2_with_one_option_changed(tmp_path: Path, tiny_checkpoint, pair, first, second):
    out = tmp_path / "bench.json"
    model, _ = tiny_checkpoint("llama", tied=False)
    r = run("bench", "throughput", "--model", str(model), "--batch-sizes", "2", "--input-len", "8", "--output-len",
            "6", "--compare", pair, "--json", str(out), "--max-model-len", "256", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())["results"]["2"]
    # fp32: two ranks give one rank's tokens; attention in place gives the gathered one's; graphs eager's
    assert res["identical_completions"] == 2
    assert res[f"ratio_{first}_over_{second}"] == pytest.approx(res["pair_ratios"][0])
    assert f"ratio {first}/{second}" in r.stdout


def test_bench_throughput_times_structured_output_beside_unconstrained(tmp_path: Path):
    out = tmp_path / "bench.json"
    r = run("bench", "throughput", "--batch-sizes", "2", "--input-len", "8", "--output-len", "12", "--structured",
            "json", "--json", str(out), "--max-model-len", "256", "--enforce-eager", exact=False)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())["results"]["2"]
    assert res["ratio_structured_over_unconstrained"] == pytest.approx(res["pair_ratios"][0])
    assert res["structured"]["output_tok_s"] > 0 and res["unconstrained"]["output_tok_s"] > 0
    assert "ratio structured/unconstrained" in r.stdout

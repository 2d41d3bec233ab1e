"""The throughput benchmark's summary table and plot."""

from __future__ import annotations

from mrv2.bench import report

RESULTS = {
    "1": {"mrv2": {"output_tok_s": 60.0}, "hf": {"output_tok_s": 20.0}, "identical_completions": 1},
    "16": {"mrv2": {"output_tok_s": 200.0}, "hf": {"output_tok_s": 100.0}, "llama.cpp": {"output_tok_s": 250.0}},
}


def test_table_has_each_engine_and_ratios_over_each_peer():
    lines = report.table(RESULTS, "mrv2").splitlines()
    assert lines[0] == ("| batch | mrv2 tok/s | hf tok/s | llama.cpp tok/s | mrv2/hf | mrv2/llama.cpp |")
    assert lines[2] == "| 1 | 60.0 | 20.0 | - | 3.00x | - |"
    assert lines[3] == "| 16 | 200.0 | 100.0 | 250.0 | 2.00x | 0.80x |"


def test_plot_draws_one_line_per_engine_and_writes_a_png(tmp_path):
    lines = report.figure(RESULTS, "test").axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["mrv2", "hf", "llama.cpp"]
    assert list(lines[0].get_xdata()) == [1, 16] and list(lines[0].get_ydata()) == [60.0, 200.0]
    assert list(lines[2].get_xdata()) == [16] and list(lines[2].get_ydata()) == [250.0]
    path = tmp_path / "t.png"
    report.plot(RESULTS, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

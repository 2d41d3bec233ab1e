"""`mrv2 bench spec`: speculation off vs n-gram and a layer-truncated draft model on both workloads,
outputs checked in float32."""

from __future__ import annotations

import json

from mrv2.entrypoints.cli import main


def test_a_small_run_reports_ratios_acceptance_and_identical_outputs(tmp_path, capsys):
    out = tmp_path / "spec.json"
    code = main(["bench", "spec", "--methods", "ngram,draft_model", "--draft-layers", "4", "--batch-sizes", "2", "--output-len", "12", "--passage-len", "40",
                 "--repeat", "1", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory",
                 str(32 << 20), "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"grounded b2", "open b2"}
    for row in results.values():
        assert set(row) == {"off", "ngram", "draft_model"} and row["off"]["acceptance_rate"] is None
        for method in ("ngram", "draft_model"):  # fp32: every output equal without drafts
            assert row[method]["identical"] == row["off"]["identical"]
            assert row[method]["ratio_pairs"][0] > 0
        assert row["draft_model"]["acceptance_rate"] is not None
    grounded = results["grounded b2"]["ngram"]
    assert grounded["acceptance_rate"] > 0 and grounded["mean_acceptance_length"] > 1
    assert "grounded b2" in capsys.readouterr().out


def test_eagle_without_a_head_is_refused(capsys):
    assert main(["bench", "spec", "--methods", "eagle", "--repeat", "1"]) != 0
    assert "--draft-model" in capsys.readouterr().err

"""`mrv2 bench prefix`: caching on and off side by side, outputs checked equal in float32."""

from __future__ import annotations

import json

from mrv2.bench.prefix import workload
from mrv2.entrypoints.cli import main


def test_workload_shares_the_prefix_and_differs_after_it():
    prompts = workload(4, 20, 5, 49152, 0)
    assert all(p[:20] == prompts[0][:20] and len(p) == 25 for p in prompts)
    assert len({tuple(p[20:]) for p in prompts}) == 4


def test_a_small_run_reports_both_engines_and_identical_outputs(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    code = main(["bench", "prefix", "--num-requests", "6", "--prefix-len", "48", "--suffix-len", "4",
                 "--output-len", "3", "--repeat", "1", "--dtype", "float32", "--kv-cache-memory", str(16 << 20),
                 "--json", str(out), "--enforce-eager"])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"caching on", "caching off"} and result["identical_outputs"] == 6
    assert len(result["throughput_ratio_pairs"]) == 1 and result["throughput_ratio_pairs"][0] > 0
    assert "caching on / off" in capsys.readouterr().out

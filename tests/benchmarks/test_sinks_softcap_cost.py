"""benchmarks/sinks_softcap_cost.py at a tiny size: the four configurations run interleaved and
the result file holds each one's times and its ratio to plain (no timing is asserted)."""

import json

from benchmarks import sinks_softcap_cost


def test_sinks_softcap_cost_tiny_run(tmp_path):
  out = tmp_path / "cost.json"
  result = sinks_softcap_cost.main(["--length", "128", "--heads", "2", "--kv-heads", "1",
                                    "--head-dim", "8,16", "--repeats", "2", "--out", str(out)])
  written = json.loads(out.read_text())
  assert written["command"].startswith("python benchmarks/sinks_softcap_cost.py --length 128")
  configs = list(sinks_softcap_cost.CONFIGS)
  assert [(r["head_dim"], r["config"]) for r in written["rows"]] == (
      [(8, c) for c in configs] + [(16, c) for c in configs])
  assert written["ring"] == 8 and written["length"] == 128 and written["head_dims"] == [8, 16]
  for rows in (written["rows"][:4], written["rows"][4:]):
    plain = rows[0]
    assert plain["ratio_cpu"] == 1.0 and plain["ratio_wall"] == 1.0
    for row in rows:
      assert len(row["cpu_s"]) == len(row["wall_s"]) == 2
      assert row["best_cpu_s"] == min(row["cpu_s"]) and row["best_wall_s"] > 0
      assert row["ratio_cpu"] == row["best_cpu_s"] / plain["best_cpu_s"]
  assert result["rows"] == written["rows"]

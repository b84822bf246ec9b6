"""tools/bench end to end, at its smallest: one short run of each kind.

Not a speed test (ratios on a shared 2-core machine mean nothing in a unit
test): it checks that the tool runs stock, ours and async on a real process
cluster and writes what its README promises, so that a broken benchmark
shows up in CI rather than in the next person's measurement.
"""

import json
import pathlib
import subprocess
import sys

import support

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_writes_runs_summary_table_and_plot(tmp_path):
  out = tmp_path / "bench"
  grace = 1.0
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "bench"), "--scenarios",
       "small", "--workers", "1", "--reps", "1", "--secs", "0.5",
       "--grace", str(grace), "--out", str(out)],
      capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

  runs = [json.loads(line) for line in
          (out / "runs.jsonl").read_text().splitlines()]
  assert sorted(r["impl"] for r in runs) == ["async", "ours", "stock"]
  for run in runs:
    metrics = run["metrics"]
    assert metrics["global_steps_per_s"] > 0, run
    assert 0 < metrics["step_ms_p50"] <= metrics["step_ms_p95"], run
    assert metrics["peak_rss_mb"] > 0, run
  by_impl = {r["impl"]: r["metrics"] for r in runs}
  # Stock's chief close waits out the grace period (its runner is stuck in
  # take_grad); ours closes at once.
  assert by_impl["stock"]["chief_close_s"] >= 0.9 * grace, by_impl["stock"]
  assert by_impl["ours"]["chief_close_s"] < 0.5 * grace, by_impl["ours"]

  (summary,) = [json.loads(line) for line in
                (out / "summary.jsonl").read_text().splitlines()]
  assert (summary["scenario"], summary["workers"]) == ("small", 1)
  ratio = summary["ours_vs_stock_grads"]
  assert ratio == by_impl["ours"]["grads_per_s"] / by_impl["stock"][
      "grads_per_s"]
  assert summary["ours_sync_vs_async_grads"] > 0
  assert summary["read_ms_p50"] > 0

  table = (out / "table.txt").read_text()
  assert "small" in table and "%.2f" % ratio in table, table
  assert (out / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_compares_packed_reads_with_stock_on_plain_reads(tmp_path):
  out = tmp_path / "bench"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "bench"), "--scenarios",
       "many,many_packed_reads", "--workers", "1", "--reps", "1",
       "--impls", "stock,ours", "--secs", "0.5", "--grace", "1",
       "--out", str(out)],
      capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  summary = {e["scenario"]: e for e in map(
      json.loads, (out / "summary.jsonl").read_text().splitlines())}
  assert sorted(summary) == ["many", "many_packed_reads"]
  # Both models read every variable: the floor is measured for each.
  assert all(e["read_ms_p50"] > 0 for e in summary.values()), summary
  cross = summary["many_packed_reads"]["ours_vs_stock_plain_reads_grads"]
  assert cross > 0, summary
  assert "ours_vs_stock_plain_reads_grads" not in summary["many"]
  assert ("ours on many_packed_reads / stock on many, W=1: %.2f" % cross
          in (out / "table.txt").read_text())


def test_median_interval_is_the_sign_test_interval():
  bench = support.load_tool("bench")
  assert bench.median_interval([1.0]) is None
  # Too few repetitions for 90%: the whole range, at its real coverage.
  assert bench.median_interval([1.1, 0.9, 1.0]) == (0.9, 1.1, 0.75)
  assert bench.median_interval([5, 1, 4, 2, 3]) == (1, 5, 1 - 2 / 32)
  # 8 values: the 2nd smallest and 2nd largest cover with 1 - 2*9/256.
  low, high, coverage = bench.median_interval([8, 3, 1, 7, 2, 6, 5, 4])
  assert (low, high) == (2, 7)
  assert coverage == 1 - 2 * 9 / 256
  # A higher target widens it.
  assert bench.median_interval(list(range(8)), confidence=0.99)[:2] == (0, 7)


def test_verdict_calls_a_cell_slower_only_when_its_interval_is():
  bench = support.load_tool("bench")
  assert bench.verdict(None) is None
  assert bench.verdict((0.83, 0.95, 0.93)) == "slower"
  assert bench.verdict((1.02, 1.3, 0.93)) == "faster"
  assert bench.verdict((0.9, 1.2, 0.93)) == "equal within noise"
  assert bench.verdict((0.9, 1.0, 0.93)) == "equal within noise"


def test_summary_reports_the_interval_of_ours_over_stock():
  bench = support.load_tool("bench")
  rows = []
  for rep, (stock, ours) in enumerate([(100, 90), (100, 95), (200, 180),
                                       (100, 80), (50, 47)]):
    for impl, grads in (("stock", stock), ("ours", ours)):
      rows.append({"scenario": "flat", "workers": 1, "impl": impl,
                   "rep": rep, "metrics": {"grads_per_s": grads,
                                           "global_steps_per_s": grads}})
  (entry,) = bench.summarize(rows)
  assert entry["ours_vs_stock_grads"] == 0.9
  assert entry["ours_vs_stock_grads_interval"] == [0.8, 0.95]
  assert entry["ours_vs_stock_verdict"] == "slower"
  text = bench.table([entry])
  assert "0.80-0.95" in text and "ours slower than stock: flat W=1" in text

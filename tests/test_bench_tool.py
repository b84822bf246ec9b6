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

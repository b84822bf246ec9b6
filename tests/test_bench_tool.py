"""tools/bench end to end, at its smallest, and its report on known numbers.

Not a speed test (ratios on a shared 2-core machine mean nothing in a unit
test): it checks that the tool runs stock, ours and async on a real process
cluster and writes what docs/benchmarks.md promises, so that a broken
benchmark shows up in CI rather than in the next person's measurement. The
report's statistics (tools/bench_report.py) and the protocol's messages
(tools/_bench_protocol.py) are imported and checked directly.
"""

import collections
import itertools
import json
import pathlib
import statistics
import subprocess
import sys

import pytest

import support

sys.path.insert(0, str(support.TOOLS))
import _bench_protocol  # pylint: disable=g-import-not-at-top
import bench_report  # pylint: disable=g-import-not-at-top

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The end-to-end runs' own bounds: a stuck run or session.run fails with
#: the tool's message well inside subprocess.run's timeout (240-300 s),
#: where the tool's defaults (300 and 120 s) would let that kill it first.
_BOUNDS = ("--run-timeout", "120", "--op-timeout", "90")


@pytest.mark.scale(reason=(
    "tools/bench end to end (its task processes, about 20 CPU-seconds): "
    "its bookkeeping is proven on made-up runs by this file's other tests "
    "(intervals, verdicts, summaries, run specs), stock's and ours' "
    "closes by test_shutdown"))
def test_bench_writes_runs_summary_table_and_plot(tmp_path):
  out = tmp_path / "bench"
  # Long enough that ours' prompt close, on a loaded machine too, stays far
  # below the wait stock's close makes (measured in this same run).
  grace = 3.0
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "bench"), "--scenarios",
       "small", "--workers", "1", "--reps", "1", "--secs", "0.5",
       "--grace", str(grace), "--out", str(out), *_BOUNDS,
       # On the small model, where it costs least: it was two runs of the
       # 200-variable model in the test below, about 10 CPU-seconds.
       "--variant", 'fused={"fuse_dense_gradients": true}'],
      capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

  runs = [json.loads(line) for line in
          (out / "runs.jsonl").read_text().splitlines()]
  assert sorted(r["impl"] for r in runs) == ["async", "fused", "ours",
                                             "stock"]
  # The variant ran as ours built with its options, and only it did.
  built = {}
  for line in (out / "tasks" / "records.jsonl").read_text().splitlines():
    run = json.loads(line)
    for record in run["records"]:
      built.setdefault(run["impl"], []).append(record["optimizer_options"])
  assert built == {"stock": [{}], "ours": [{}],
                   "fused": [{"fuse_dense_gradients": True}],
                   "async": [{}]}, built
  for run in runs:
    metrics = run["metrics"]
    assert metrics["global_steps_per_s"] > 0, run
    assert 0 < metrics["step_ms_p50"] <= metrics["step_ms_p95"], run
    assert metrics["peak_rss_mb"] > 0, run
    assert metrics["ps_peak_rss_mb"] > 0, run
  by_impl = {r["impl"]: r["metrics"] for r in runs}
  # Stock's chief close waits out the grace period (its runner is stuck in
  # take_grad); ours closes at once: in under half the time stock's took
  # in this run, which a loaded machine's prompt close (tenths of a second)
  # is far from.
  assert by_impl["stock"]["chief_close_s"] >= 0.9 * grace, by_impl["stock"]
  assert (by_impl["ours"]["chief_close_s"]
          < 0.5 * by_impl["stock"]["chief_close_s"]), by_impl

  (summary,) = [json.loads(line) for line in
                (out / "summary.jsonl").read_text().splitlines()]
  assert (summary["scenario"], summary["workers"]) == ("small", 1)
  ratio = summary["ours_vs_stock_grads"]
  assert ratio == by_impl["ours"]["grads_per_s"] / by_impl["stock"][
      "grads_per_s"]
  fused = summary["variants"]["fused"]
  assert fused["vs_ours_grads"] == (summary["fused_grads_per_s"] /
                                    summary["ours_grads_per_s"])
  assert summary["ours_sync_vs_async_grads"] > 0
  assert summary["read_ms_p50"] > 0

  table = (out / "table.txt").read_text()
  assert "small" in table and "%.2f" % ratio in table, table
  assert "fused        small" in table, table
  assert (out / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.newest_only(reason=(
    "the tool's cross ratio is its bookkeeping; packed reads themselves are "
    "proven under every version by test_reads, test_rewired_reads and "
    "test_prefetch, stock's plain reads by test_parity (39 CPU-seconds on "
    "2.15)"))
@pytest.mark.scale(reason=(
    "tools/bench end to end (its task processes, about 20 CPU-seconds): "
    "its bookkeeping is proven on made-up runs by this file's other tests "
    "(intervals, verdicts, summaries, run specs), stock's and ours' "
    "closes by test_shutdown"))
def test_bench_compares_packed_reads_with_stock_on_plain_reads(tmp_path):
  out = tmp_path / "bench"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "bench"), "--scenarios",
       "many,many_packed_reads", "--workers", "1", "--reps", "1",
       "--impls", "stock,ours", "--secs", "0.5", "--grace", "1",
       "--out", str(out), *_BOUNDS],
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


@pytest.mark.newest_only(reason=(
    "MultiWorkerMirroredStrategy and async PS are the tool's comparison "
    "peers, not the package; ours with packed reads runs under every "
    "version in test_reads and test_prefetch, and the tool's runs, table "
    "and ratios in test_bench_writes_runs_summary_table_and_plot (26 "
    "CPU-seconds on 2.15)"))
@pytest.mark.scale(reason=(
    "tools/bench end to end (its task processes, about 20 CPU-seconds): "
    "its bookkeeping is proven on made-up runs by this file's other tests "
    "(intervals, verdicts, summaries, run specs), stock's and ours' "
    "closes by test_shutdown"))
def test_bench_runs_the_peers_and_reports_ratios_to_mwms(tmp_path):
  """MultiWorkerMirroredStrategy (both communications) and async PS beside
  ours, with packed variable reads, on the smallest model at W=2."""
  out = tmp_path / "bench"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "bench"), "--scenarios", "small",
       "--workers", "2", "--reps", "1", "--impls", "mwms,mwms_ring,async",
       "--variant", 'packed={"pack_variable_reads": true}', "--secs", "0.5",
       "--grace", "1", "--out", str(out), *_BOUNDS],
      capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = [json.loads(line)
          for line in (out / "runs.jsonl").read_text().splitlines()]
  assert sorted(r["impl"] for r in rows) == [
      "async", "mwms", "mwms_ring", "ours", "packed"]
  assert all(r["metrics"]["global_steps_per_s"] > 0
             and r["metrics"]["updates_per_cpu_s"] > 0 for r in rows), rows
  # Both MWMS workers stopped at the same step (its collectives need it).
  for raw in map(json.loads, (out / "tasks" / "records.jsonl").read_text(
      ).splitlines()):
    if raw["impl"].startswith("mwms"):
      last = [record["steps_at"][-1][1] for record in raw["records"]]
      assert len(last) == 2 and last[0] == last[1] > 1, last
  (entry,) = map(json.loads, (out / "summary.jsonl").read_text().splitlines())
  assert sorted(entry["vs_peer"]) == ["async", "ours", "packed"]
  table = (out / "table.txt").read_text()
  assert "| small | 2 |" in table and "| packed / MWMS |" in table, table
  assert "updates per CPU-second of the whole job" in table, table
  # The ps pool's CPU per update names the ps and both workers; a peer's,
  # its two workers.
  assert sorted(entry["ours_task_cpu_ms_per_update"]) == [
      "ps0", "worker0", "worker1"], entry
  assert sorted(entry["mwms_task_cpu_ms_per_update"]) == [
      "worker0", "worker1"], entry


def test_median_interval_is_the_sign_test_interval():
  bench = bench_report
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
  bench = bench_report
  assert bench.verdict(None) is None
  assert bench.verdict((0.83, 0.95, 0.93)) == "slower"
  assert bench.verdict((1.02, 1.3, 0.93)) == "faster"
  assert bench.verdict((0.9, 1.2, 0.93)) == "equal within noise"
  assert bench.verdict((0.9, 1.0, 0.93)) == "equal within noise"


def test_summary_reports_the_interval_of_ours_over_stock():
  bench = bench_report
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


def _record(steps, *, spawned=100.0):
  """A chief's record of a run of ``steps`` steps, 10 ms apart."""
  steps_at = [(spawned + 1 + 0.01 * i, i + 1) for i in range(steps)]
  return {"steps_at": steps_at, "latencies": [0.01] * steps,
          "first_step_wall": spawned + 1 if steps else None,
          "spawned_wall": spawned, "close_secs": 0.01, "peak_rss_mb": 100.0}


def test_metrics_refuses_a_run_without_a_measured_window():
  with pytest.raises(bench_report.EmptyWindowError, match="1 step"):
    bench_report.metrics([_record(1)])
  with pytest.raises(bench_report.EmptyWindowError, match="0 step"):
    bench_report.metrics([_record(0)])
  assert bench_report.metrics([_record(50)])["global_steps_per_s"] > 0


def test_chief_cpu_per_update_counts_the_window_only():
  # 50 steps; the chief's process CPU grows 2 ms a step after a costly
  # first step (graph registration) that the window leaves out.
  record = _record(50)
  record["cpu_at"] = [1.0] + [1.5 + 0.002 * i for i in range(49)]
  metrics = bench_report.metrics([record])
  assert metrics["chief_cpu_ms_per_update"] == pytest.approx(2.0)
  # A record from before cpu_at existed (--from an old file): no figure.
  assert bench_report.metrics([_record(50)])[
      "chief_cpu_ms_per_update"] is None


def test_scale_scenarios_are_named_but_not_run_by_default():
  parse = support.load_tool("bench")._parse  # pylint: disable=protected-access
  default = parse([]).scenarios
  assert default == _bench_protocol.DEFAULT_SCENARIOS
  assert not set(default) & set(_bench_protocol.SCALE_SCENARIOS)
  assert parse(["--scenarios", "many,many_4000"]).scenarios == [
      "many", "many_4000"]


class _FakePool:
  """Stands in for _bench_pool.Pool: no process, nothing to wait for."""

  startup_secs = 0.0
  started = 0

  def __init__(self, workers, **_):
    self.workers = workers
    _FakePool.started += 1

  def close(self):
    pass


def test_bench_writes_its_summary_when_a_run_measures_nothing(
    tmp_path, monkeypatch, capsys):
  # Regression: metrics() raised on an empty window outside the run-error
  # handling, so the bench died without summary.jsonl or table.txt.
  bench = support.load_tool("bench")

  def run_once(pool, scenario, impl, **_):
    return [_record(50 if impl == "stock" else 1)]

  monkeypatch.setattr(bench._bench_pool, "Pool", _FakePool)
  monkeypatch.setattr(bench._bench_pool, "run_once", run_once)
  out = tmp_path / "bench"
  status = bench.main(["--scenarios", "small", "--workers", "1", "--reps",
                       "1", "--impls", "stock,ours", "--out", str(out)])
  assert status == 1
  assert "no measured window" in capsys.readouterr().err
  runs = [json.loads(line) for line in
          (out / "runs.jsonl").read_text().splitlines()]
  assert [r["impl"] for r in runs] == ["stock"]
  (summary,) = [json.loads(line) for line in
                (out / "summary.jsonl").read_text().splitlines()]
  assert summary["stock_grads_per_s"] > 0
  assert "small" in (out / "table.txt").read_text()


def test_a_run_command_carries_exactly_the_run_spec():
  spec = _bench_protocol.RunSpec(
      cluster={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
      scenario="small", impl="ours", replicas=1, options={"statistics": True},
      secs=1.0, warmup=0.2, stop_file="/tmp/stop")
  line = _bench_protocol.encode(_bench_protocol.command(
      _bench_protocol.RUN, spec))
  message = _bench_protocol.decode(line)
  assert message[_bench_protocol.CMD] == _bench_protocol.RUN
  assert _bench_protocol.run_spec(message) == spec
  # A key only one side knows is an error, not a silently ignored field.
  with pytest.raises(TypeError, match="steps"):
    _bench_protocol.run_spec(dict(message, steps=10))


@pytest.mark.parametrize("fresh", [False, True])
def test_a_fresh_pool_serves_one_run_only(tmp_path, monkeypatch, fresh):
  bench = support.load_tool("bench")
  monkeypatch.setattr(bench._bench_pool, "Pool", _FakePool)
  monkeypatch.setattr(bench._bench_pool, "run_once",
                      lambda *_, **__: [_record(50)])
  monkeypatch.setattr(_FakePool, "started", 0)
  argv = ["--scenarios", "small", "--workers", "1,2", "--reps", "2",
          "--impls", "stock,ours", "--out", str(tmp_path)]
  assert bench.main(argv + (["--fresh-pool"] if fresh else [])) == 0
  # 8 runs over 2 values of W: one pool per W, or one per run.
  assert _FakePool.started == (8 if fresh else 2)


def test_peak_rss_is_a_processes_own_since_its_last_reset():
  import _peak_rss as peak_rss  # pylint: disable=g-import-not-at-top
  # A child that touches 300 MB, frees it, says so and waits for stdin.
  child = subprocess.Popen(
      [sys.executable, "-c",
       "import sys; b = bytearray(300 << 20); del b; print('freed', "
       "flush=True); sys.stdin.read()"],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert child.stdout.readline().strip() == "freed"
    before = peak_rss.peak_mb(child.pid)
    if before is None:
      pytest.skip("no /proc/<pid>/status here")
    assert before >= 300, before
    peak_rss.reset(child.pid)
    after = peak_rss.peak_mb(child.pid)
    if after >= 300:
      pytest.skip("this kernel does not reset VmHWM via clear_refs")
    assert after < 100, after
  finally:
    child.stdin.close()
    child.wait(timeout=30)
  assert peak_rss.peak_mb(child.pid) is None  # Gone: no figure, no error.


def test_op_timeout_reaches_every_run_and_is_checked(tmp_path, monkeypatch,
                                                     capsys):
  bench = support.load_tool("bench")
  seen = []

  def run_once(pool, scenario, impl, **kwargs):
    seen.append(kwargs["op_timeout"])
    return [_record(50)]

  monkeypatch.setattr(bench._bench_pool, "Pool", _FakePool)
  monkeypatch.setattr(bench._bench_pool, "run_once", run_once)
  argv = ["--scenarios", "small", "--workers", "1", "--reps", "1", "--impls",
          "stock,ours", "--out", str(tmp_path)]
  assert bench.main(argv + ["--op-timeout", "900", "--run-timeout",
                            "1800"]) == 0
  assert seen == [900.0, 900.0]
  with pytest.raises(SystemExit):
    bench.main(argv + ["--op-timeout", "600"])  # Over --run-timeout's 300.
  assert "--op-timeout must be > 0 and at most --run-timeout (300), got " \
      "600.0" in capsys.readouterr().err
  # The spec a task reads carries it, and defaults to the old fixed 120 s.
  spec = _bench_protocol.RunSpec(
      cluster={}, scenario="small", impl="ours", replicas=1, options={},
      secs=1.0, warmup=0.2, stop_file="/tmp/stop")
  assert spec.op_timeout_secs == 120.0


def test_a_variant_is_ours_with_its_options_reported_against_ours(
    tmp_path, monkeypatch, capsys):
  bench = support.load_tool("bench")
  seen = []
  grads = iter([100, 90, 120, 100, 95, 110])  # ours, var, ours, var, ...

  def run_once(pool, scenario, impl, **kwargs):
    seen.append((impl, kwargs["options"]))
    record = _record(50)
    speed = next(grads) / 100  # This run's speed, against _record's.
    record["steps_at"] = [(101 + (t - 101) / speed, s)
                          for t, s in record["steps_at"]]
    return [record]

  monkeypatch.setattr(bench._bench_pool, "Pool", _FakePool)
  monkeypatch.setattr(bench._bench_pool, "run_once", run_once)
  argv = ["--scenarios", "small", "--workers", "1", "--reps", "3",
          "--impls", "ours", "--options", '{"statistics_log_steps": 0}',
          "--out", str(tmp_path)]
  assert bench.main(argv + ["--variant", 'st={"statistics": true}']) == 0
  # Rotated like any implementation; the tasks see ours, with both options.
  both = {"statistics_log_steps": 0, "statistics": True}
  assert seen == [("ours", {"statistics_log_steps": 0}), ("ours", both),
                  ("ours", both), ("ours", {"statistics_log_steps": 0}),
                  ("ours", {"statistics_log_steps": 0}), ("ours", both)]
  runs = [json.loads(line) for line in
          (tmp_path / "runs.jsonl").read_text().splitlines()]
  assert [r["impl"] for r in runs] == ["ours", "st", "st", "ours", "ours",
                                       "st"]
  assert runs[1]["options"] == both
  (entry,) = [json.loads(line) for line in
              (tmp_path / "summary.jsonl").read_text().splitlines()]
  variant = entry["variants"]["st"]
  by_rep = {}
  for r in runs:
    by_rep.setdefault(r["rep"], {})[r["impl"]] = r["metrics"]["grads_per_s"]
  ratios = sorted(m["st"] / m["ours"] for m in by_rep.values())
  assert ratios[0] < 1 < ratios[-1], ratios  # About 0.9, 1.16 and 1.2.
  # Three repetitions: the median, and the whole range at 75%.
  assert variant["reps"] == 3
  assert variant["vs_ours_grads"] == ratios[1]
  assert variant["vs_ours_grads_interval"] == [ratios[0], ratios[-1]]
  assert variant["vs_ours_grads_coverage"] == 0.75
  assert variant["vs_ours_verdict"] == "equal within noise"
  assert "st           small" in (tmp_path / "table.txt").read_text()

  for bad, why in (("st", "NAME=JSON"), ("st=[1]", "NAME=JSON"),
                   ("st={bad", "NAME=JSON"), ("ours={}", "identifier"),
                   ("9x={}", "identifier")):
    with pytest.raises(SystemExit):
      bench.main(argv + ["--variant", bad])
    assert why in capsys.readouterr().err, bad


def _reads_the_gradients_need(scenario, *, control_edges):
  """The variables whose reads the scenario's gradients need, as the bench's
  optimizer computes them (GradientDescent's ``compute_gradients``, its
  default gating, GATE_OP), following data edges and, if
  ``control_edges``, control edges too; and the model's variable count."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import _bench_task  # pylint: disable=g-import-not-at-top

  cluster = tf.train.ClusterSpec({"ps": ["a:1"], "worker": ["w:1"]})
  with tf.Graph().as_default(), tf.compat.v1.device(
      tf.compat.v1.train.replica_device_setter(cluster=cluster)):
    loss = _bench_task.build_model(scenario, np.random.default_rng(0))
    variables = tf.compat.v1.trainable_variables()
    grads = tf.compat.v1.train.GradientDescentOptimizer(
        0.1).compute_gradients(loss, variables)
    stack, seen = [g.op for g, _ in grads], set()
    while stack:  # Every op the gradients need.
      op = stack.pop()
      if op not in seen:
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        if control_edges:
          stack.extend(op.control_inputs)
    handles = {v.handle.op: v.name for v in variables}
    read = {handles[op.inputs[0].op] for op in seen
            if op.type == "ReadVariableOp" and op.inputs[0].op in handles}
    return read, len(variables)


def test_many_reads_its_variables_only_through_gating_many_stacked_for_data():
  """The linear model's gradients are its input (d loss / d v = x), so no
  gradient needs a variable's value; its step still reads all 200, because
  GATE_OP groups each Mul's two input gradients and the data input's is
  grad * v. "many_stacked" (the same 200 variables as one tanh layer's
  matrix) needs every value as data, as a real model's gradients do."""
  read, count = _reads_the_gradients_need("many", control_edges=False)
  assert count == 200 and not read, sorted(read)[:5]
  read, count = _reads_the_gradients_need("many", control_edges=True)
  assert count == 200 and len(read) == 200, len(read)
  read, count = _reads_the_gradients_need("many_stacked", control_edges=False)
  assert count == 200 and len(read) == 200, len(read)


def test_a_variants_ps_config_gets_a_pool_of_its_own_not_the_optimizer(
    tmp_path, monkeypatch, capsys):
  # The ps's own server settings, measured interleaved against the
  # default server (docs/benchmarks.md, "The ps server's own settings").
  bench = support.load_tool("bench")
  pools, seen = [], []

  class Pool(_FakePool):

    def __init__(self, workers, **kwargs):
      super().__init__(workers, **kwargs)
      self.ps_config = kwargs.get("ps_config")
      pools.append(self.ps_config)

  def run_once(pool, scenario, impl, **kwargs):
    seen.append((impl, kwargs["options"], pool.ps_config))
    return [_record(50)]

  monkeypatch.setattr(bench._bench_pool, "Pool", Pool)
  monkeypatch.setattr(bench._bench_pool, "run_once", run_once)
  nospin = "experimental { disable_thread_spinning: true }"
  argv = ["--scenarios", "small", "--workers", "1", "--reps", "2",
          "--impls", "stock", "--out", str(tmp_path),
          "--variant", 'f={"fuse_dense_gradients": true}',
          "--variant", json.dumps({"fuse_dense_gradients": True,
                                   "ps_config": nospin}).join(["fn=", ""])]
  assert bench.main(argv) == 0
  # Two ps pools, each started once; the option never reaches the tasks'
  # optimizer options, and every other implementation runs on the default.
  assert pools == [None, nospin]
  fused = json.dumps({"fuse_dense_gradients": True})
  assert collections.Counter(
      (i, json.dumps(o), c) for i, o, c in seen) == {
          ("stock", "{}", None): 2, ("ours", "{}", None): 2,
          ("ours", fused, None): 2, ("ours", fused, nospin): 2}
  runs = [json.loads(line) for line in
          (tmp_path / "runs.jsonl").read_text().splitlines()]
  assert {(r["impl"], r["ps_config"]) for r in runs} == {
      ("stock", None), ("ours", None), ("f", None), ("fn", nospin)}
  # --ps-config sets every ps pool's; a variant's "" takes it back.
  pools.clear()
  seen.clear()
  assert bench.main(argv[:-4] + ["--ps-config", nospin, "--variant",
                                 'd={"ps_config": ""}']) == 0
  assert pools == [nospin, None]
  assert {(i, c) for i, _, c in seen} == {
      ("stock", nospin), ("ours", nospin), ("ours", None)}
  with pytest.raises(SystemExit):
    bench.main(argv[:-4] + ["--variant", 'b={"ps_config": 1}'])
  assert "'ps_config' must be a ConfigProto in protobuf's text format" in (
      capsys.readouterr().err)


def test_the_bench_ps_starts_its_server_with_the_ps_config():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import _bench_task  # pylint: disable=g-import-not-at-top

  text = ("inter_op_parallelism_threads: 1 "
          "experimental { disable_thread_spinning: true }")
  config = _bench_task.server_config("ps", text)
  expected = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
  expected.experimental.disable_thread_spinning = True
  assert config == expected
  assert _bench_task.server_config("ps", None) is None
  assert _bench_task.server_config("worker", text) is None  # The ps's only.
  # It crosses to the task on its command line.
  spec = _bench_protocol.ServeSpec(cluster={"ps": ["127.0.0.1:1"]}, job="ps",
                                   task=0, ps_config=text)
  assert _bench_protocol.serve_spec(
      _bench_protocol.serve_argument(spec)) == spec


#: A saved peers run (runs.jsonl as tools/bench wrote it), committed with
#: docs/benchmarks.md's tables of it.
PEERS_RUN = ROOT / "docs" / "peers" / "after-2026-11-28.jsonl"


def _rows(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _render(monkeypatch, capsys, *paths):
  """``tools/bench --render paths``: (exit status, stdout, stderr)."""
  bench = support.load_tool("bench")

  def no_cluster(*_, **__):
    raise AssertionError("--render started a cluster or a run")

  monkeypatch.setattr(bench._bench_pool, "Pool", no_cluster)
  monkeypatch.setattr(bench._bench_pool, "run_once", no_cluster)
  status = bench.main(["--render", *map(str, paths)])
  out, err = capsys.readouterr()
  return status, out, err


@pytest.mark.version_independent
def test_render_prints_a_saved_runs_report_and_the_docs_tables_are_it():
  # The command docs/benchmarks.md gives, as a user runs it.
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "bench"), "--render",
       str(PEERS_RUN.relative_to(ROOT))], cwd=ROOT, capture_output=True,
      text=True, timeout=60, check=False)
  assert proc.returncode == 0 and not proc.stderr, proc.stderr
  summary = bench_report.summarize(_rows(PEERS_RUN))
  assert proc.stdout == bench_report.table(summary) + "\n"
  # The doc's two peers tables of this run (updates/s with each one's ratio
  # to the better MWMS and its bracket; updates per CPU-second) are lines
  # of the render, header to last row.
  section = (ROOT / "docs" / "benchmarks.md").read_text().split(
      "### The peers table after the levers", 1)[1].split(
          "Before and after, per model", 1)[0]
  assert ("tools/bench --render docs/peers/after-2026-11-28.jsonl"
          in section), section[:2000]
  doc_rows = [line for line in section.splitlines() if line.startswith("|")]
  assert len(doc_rows) == 2 * (2 + 7), doc_rows  # 7 models at W = 2.
  lines = proc.stdout.splitlines()
  assert [row for row in doc_rows if row not in lines] == [], proc.stdout


@pytest.mark.version_independent
def test_render_splits_each_cells_cpu_per_update_by_process(monkeypatch,
                                                            capsys):
  status, out, _ = _render(monkeypatch, capsys, PEERS_RUN)
  assert status == 0
  part = out.split("CPU ms per update, by process", 1)[1].splitlines()
  rows = [line for line in part if line.startswith("| ")]
  assert rows[0] == "| model | W | impl | ps0 | worker0 | worker1 | sum |"
  # Every model and implementation of the run, each process's median over
  # the repetitions (computed here from the raw runs), and their sum.
  runs = _rows(PEERS_RUN)
  assert len(rows) - 1 == len({(r["scenario"], r["impl"]) for r in runs})
  for model, workers, impl, *cells, total in (
      row.strip("| ").split(" | ") for row in rows[1:]):
    by_task = collections.defaultdict(list)
    for r in runs:
      if (r["scenario"], str(r["workers"]), r["impl"]) == (model, workers,
                                                           impl):
        for task, ms in r["metrics"]["task_cpu_ms_per_update"].items():
          by_task[task].append(ms)
    medians = {t: sum(ms) / len(ms) for t, ms in by_task.items()}  # Of 2.
    assert all(len(ms) == 2 for ms in by_task.values()), by_task
    assert cells == ["%.2f" % medians[t] if t in medians else "-"
                     for t in ("ps0", "worker0", "worker1")], (model, impl)
    assert float(total) == pytest.approx(sum(medians.values()), abs=0.006)
    # A peer has no ps; every ps implementation has one.
    assert (cells[0] == "-") == impl.startswith("mwms"), (model, impl)


@pytest.mark.version_independent
def test_render_merges_saved_runs_into_one_report(tmp_path, monkeypatch,
                                                  capsys):
  runs = _rows(PEERS_RUN)
  first = {"small", "medium", "mlp"}
  part_a = _write(tmp_path / "a.jsonl",
                  [r for r in runs if r["scenario"] in first])
  part_b = _write(tmp_path / "b.jsonl",
                  [r for r in runs if r["scenario"] not in first])
  whole = _render(monkeypatch, capsys, PEERS_RUN)
  assert whole[0] == 0
  # Two files of one run's cells are that run's report, in either order.
  assert _render(monkeypatch, capsys, part_a, part_b) == whole
  assert _render(monkeypatch, capsys, part_b, part_a) == whole
  # A later run at W = 4 (here: the many model's runs again, as W = 4)
  # joins the W = 2 one's tables, each model's W = 4 row after its W = 2.
  later = _write(tmp_path / "w4.jsonl",
                 [dict(r, workers=4) for r in runs if r["scenario"] == "many"])
  status, out, err = _render(monkeypatch, capsys, PEERS_RUN, later)
  assert status == 0 and not err, err
  lines = out.splitlines()
  for head in ("| model | W | stock | ours | mwms |",
               "| model | W | impl |"):
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    table = list(itertools.takewhile(lambda line: line.startswith("|"),
                                     lines[start:]))
    models = [tuple(line.split(" | ")[:2]) for line in table[2:]]
    assert models.index(("| many", "2")) < models.index(("| many", "4")) < (
        models.index(("| flat", "2"))), table
  ps0 = "| many | 4 | ours | %.2f | " % statistics.median(
      r["metrics"]["task_cpu_ms_per_update"]["ps0"] for r in runs
      if (r["scenario"], r["impl"]) == ("many", "ours"))
  assert any(line.startswith(ps0) for line in lines), out


def _render_error_case(case, tmp_path):
  """The --render arguments of ``case``, and what its error must say."""
  runs = _rows(PEERS_RUN)
  copy = tmp_path / "copy.jsonl"
  if case == "missing":
    return [tmp_path / "nothing.jsonl"], [
        "no such file: %s" % (tmp_path / "nothing.jsonl"),
        "runs/bench/runs.jsonl"]
  if case == "folder":
    return [tmp_path], ["%s is a folder: give the runs.jsonl in it (%s)" % (
        tmp_path, tmp_path / "runs.jsonl")]
  if case == "empty":
    (tmp_path / "runs.jsonl").write_text("")
    return [tmp_path / "runs.jsonl"], ["holds no runs",
                                       "a runs.jsonl with runs in it"]
  if case == "table_txt":
    (tmp_path / "table.txt").write_text(bench_report.table(
        bench_report.summarize(runs)))
    return [tmp_path / "table.txt"], ["table.txt line 1 is not JSON",
                                      "one JSON object a line"]
  if case == "summary_jsonl":
    _write(tmp_path / "summary.jsonl", bench_report.summarize(runs))
    return [tmp_path / "summary.jsonl"], [
        "summary.jsonl line 1 has no impl, rep, metrics",
        "give the runs.jsonl beside it"]
  if case == "records_jsonl":
    _write(tmp_path / "records.jsonl", [
        {k: r[k] for k in ("scenario", "workers", "impl", "rep")}
        | {"records": []} for r in runs])
    return [tmp_path / "records.jsonl"], [
        "records.jsonl line 1 has no metrics", "tasks/records.jsonl",
        "the folder above it"]
  if case == "linkcost":
    linkcost = ROOT / "docs" / "linkcost" / "mlp-200mbit.jsonl"
    return [linkcost], ["%s line 1 is a run of tools/linkcost" % linkcost,
                        "tools/linkcost --render"]
  if case == "edited":
    _write(copy, runs[:5] + [dict(runs[5], workers="2")] + runs[6:])
    return [copy], ['copy.jsonl line 6 has workers "2", where tools/bench '
                    "writes an int, 1 or more"]
  if case == "two_runs_in_one_file":
    _write(copy, runs + runs)
    return [copy], ["copy.jsonl line 113 and line 1 are both the run of "
                    "mlp at W = 2, stock, repetition 0",
                    "give them to --render as two files"]
  if case == "a_cell_in_two_files":
    _write(copy, [r for r in runs if r["scenario"] == "flat"])
    return [PEERS_RUN, copy], [
        "%s and %s both hold runs of flat at W = 2" % (PEERS_RUN, copy),
        "render the files apart"]
  if case == "a_file_twice":
    return [PEERS_RUN, PEERS_RUN], ["%s is given twice" % PEERS_RUN]
  later = [dict(r, workers=4) for r in runs]
  if case == "a_name_with_other_options":
    for r in later:
      if r["impl"] == "fused_packed":
        r["options"] = {"fuse_dense_gradients": True}
    _write(copy, later)
    first = 1 + [r["impl"] for r in runs].index("fused_packed")
    return [PEERS_RUN, copy], [
        "'fused_packed' has options {\"fuse_dense_gradients\": true, "
        "\"pack_variable_reads\": true} at %s line %d but "
        "{\"fuse_dense_gradients\": true} at %s line %d" % (
            PEERS_RUN, first, copy, first), "render them apart"]
  assert case == "stock_on_another_ps_config", case
  for r in later:
    if r["impl"] == "stock":
      r["ps_config"] = "inter_op_parallelism_threads: 1"
  _write(copy, later)
  return [PEERS_RUN, copy], ["'stock' has ps_config null at %s line 1 but "
                             "\"inter_op_parallelism_threads: 1\" at %s "
                             "line 1" % (PEERS_RUN, copy)]


@pytest.mark.version_independent
@pytest.mark.parametrize("case", [
    "missing", "folder", "empty", "table_txt", "summary_jsonl",
    "records_jsonl", "linkcost", "edited", "two_runs_in_one_file",
    "a_cell_in_two_files", "a_file_twice", "a_name_with_other_options",
    "stock_on_another_ps_config"])
def test_render_refuses_what_is_not_a_run_or_cannot_merge(
    case, tmp_path, monkeypatch, capsys):
  paths, said = _render_error_case(case, tmp_path)
  status, out, err = _render(monkeypatch, capsys, *paths)
  assert (status, out) == (2, ""), out
  assert err.startswith("bench --render: ") and err.count("\n") == 1, err
  assert [s for s in said if s not in err] == [], err


@pytest.mark.version_independent
def test_render_refuses_the_options_of_a_run(capsys):
  bench = support.load_tool("bench")
  for argv, said in (
      (["--quick"], "so --quick would do nothing: drop it"),
      (["--reps", "5", "--out", "x"],
       "so --reps and --out would do nothing: drop them")):
    with pytest.raises(SystemExit) as exit_info:
      bench.main(["--render", str(PEERS_RUN), *argv])
    assert exit_info.value.code == 2
    assert ("--render prints the report of saved runs and runs nothing, "
            + said) in capsys.readouterr().err

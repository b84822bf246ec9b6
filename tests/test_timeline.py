"""The barrier's timeline (``timeline_dir``) and its merge command.

* The merge, on records written by hand: clocks put on the chief's, stale
  pushes, which worker each update waited for, the Chrome trace's rows.
* The writer: never blocks or raises, drops what does not fit, logs a
  failed disk once.
* The graph: a timeline adds ops only in our scope, and a run that does not
  run the train op takes no token.
* A real process cluster (1 ps, 3 workers, one with a fixed delay in its
  input): the merged trace alone names the slow worker as the one the others
  wait for, and the PNG is drawn.
"""

import json
import logging
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import _timeline
from sync_replicas import _timeline_writer
from sync_replicas import timeline
from sync_replicas._ports import LOOPBACK
from sync_replicas._ports import free_ports

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASK = pathlib.Path(__file__).with_name("timeline_task.py")


def _write(directory, name, records):
  directory.mkdir(parents=True, exist_ok=True)
  with open(directory / name, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def _scripted(directory, *, skew=0.0):
  """Two workers, 3 updates; worker1 is 0.5 s slower to compute every
  step, and its clock runs ``skew`` seconds behind the chief's."""
  updates, w0, w1 = [], [], []
  t = 100.0
  for step in range(1, 4):
    # worker0 pushes at t + 0.1, worker1 at t + 0.6; the chief's takes
    # return at t + 0.61 and the tokens arrive at t + 0.7.
    w0.append(dict(kind="step", began=t, grads=t + 0.05, pushed=t + 0.1,
                   token=t + 0.7, step=step - 1, got=step))
    w1.append(dict(kind="step", began=t - skew, grads=t + 0.55 - skew,
                   pushed=t + 0.6 - skew, token=t + 0.71 - skew,
                   step=step - 1, got=step))
    updates.append(dict(kind="update", began=t, taken=t + 0.61,
                        applied=t + 0.65, released=t + 0.66, step=step))
    t += 1.0
  # A late push of worker1 at local step 0, after update 1: stale.
  w1.append(dict(kind="step", began=t - skew, grads=t + 0.01 - skew,
                 pushed=t + 0.02 - skew, token=t + 0.1 - skew, step=0,
                 got=3))
  _write(directory, "worker0.chief.jsonl", updates)
  _write(directory, "worker0.worker.jsonl", w0)
  _write(directory, "worker1.worker.jsonl", w1)


def test_merge_names_the_worker_updates_waited_for(tmp_path):
  _scripted(tmp_path)
  rows, _ = timeline.merge(str(tmp_path), out=str(tmp_path / "t.json"))
  assert rows["worker1"]["waited_for_last"] == 3
  assert rows["worker0"]["waited_for_last"] == 0
  assert timeline.straggler(rows) == "worker1"
  assert rows["worker1"]["stale_pushes"] == 1
  assert rows["worker0"]["stale_pushes"] == 0
  trace = json.loads((tmp_path / "t.json").read_text())
  assert trace["otherData"]["clock_offsets_secs"] == {}
  names = {e["args"]["name"] for e in trace["traceEvents"]
           if e["ph"] == "M" and e["name"] == "process_name"}
  assert names == {"worker0 (chief)", "worker1"}
  updates = [e for e in trace["traceEvents"]
             if e["name"].startswith("update to step")]
  assert [e["args"]["global_step"] for e in updates] == [1, 2, 3]
  assert {e["args"]["waited_for"] for e in updates} == {"worker1"}


def test_files_of_earlier_releases_name_their_tasks_as_every_line_does(
    tmp_path):
  """Files written as worker-1.worker.jsonl (before one numbering) read as
  worker1, the name the launcher's labels and the package's lines use."""
  _scripted(tmp_path)
  for path in tmp_path.glob("*.jsonl"):
    path.rename(path.with_name(path.name.replace("worker", "worker-", 1)))
  assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == [
      "worker-0.chief.jsonl", "worker-0.worker.jsonl", "worker-1.worker.jsonl"]
  rows, _ = timeline.merge(str(tmp_path), out=str(tmp_path / "t.json"))
  assert sorted(rows) == ["worker0", "worker1"], rows
  assert timeline.straggler(rows) == "worker1"


def test_a_clock_proven_behind_is_moved_forward_by_the_proof(tmp_path):
  """worker1's clock runs 5 s behind: its tokens arrive, on its clock,
  4.29 s before the chief began the runs that released them (they arrive
  0.71 s after). It moves forward by that much, and no more."""
  _scripted(tmp_path, skew=5.0)
  updates, steps, _ = timeline.read(str(tmp_path))
  offsets = timeline.clock_offsets(updates, steps)
  assert dict(offsets) == {"worker1": pytest.approx(5.0 - 0.71)}
  _, shifted, _ = timeline.aligned(updates, steps)
  began = {u.step: u.began for u in updates}
  assert all(s.token >= began[s.got] - 1e-9 for s in shifted if s.got in began)


def test_merge_command_prints_the_verdict_and_draws(tmp_path):
  pytest.importorskip("matplotlib")
  _scripted(tmp_path)
  png = tmp_path / "last.png"
  done = subprocess.run(
      [sys.executable, "-m", "sync_replicas.timeline", str(tmp_path),
       "--png", str(png), "--last", "2"], capture_output=True, text=True,
      timeout=120, env=dict(os.environ, PYTHONPATH=support.pythonpath(ROOT)))
  assert done.returncode == 0, done.stderr
  # The picture's words (the walk of issue 46: a bare "waited for last most
  # often: chief0" ended a healthy run's merge, as if the chief lagged).
  assert done.stdout.endswith(
      "\neach update's last needed push came from worker1 in 3 of 3: "
      "worker1 is the straggler the others wait for\n"), done.stdout
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (tmp_path / "trace.json").exists()


def test_merge_takes_the_latest_run_unless_told_all(tmp_path):
  # Two runs appended to one directory (issue 38: a relaunch in the same
  # logdir resumed and appended): the second run's chief began at 150.
  first, second = tmp_path / "first", tmp_path / "second"
  _scripted(first)
  _scripted(second)
  for name in ("worker0.chief.jsonl", "worker0.worker.jsonl",
               "worker1.worker.jsonl"):
    later = [json.loads(line) for line in
             (second / name).read_text().splitlines()]
    for r in later:
      for key in ("began", "grads", "pushed", "token", "taken", "applied",
                  "released"):
        if key in r:
          r[key] += 100.0
    start = [dict(kind="start", began=99.0, pid=1)]
    # The second run's chief began at 150: said in its train steps' file
    # only (a resume past its last step applies no update: issue 38).
    again = [dict(kind="start", began=150.0 if name.startswith("worker0.w")
                  else 151.0, pid=2)]
    records = [json.loads(line) for line in
               (first / name).read_text().splitlines()]
    if name == "worker0.chief.jsonl":
      again = []  # Nothing of the second run in the sync loop's file.
    _write(tmp_path / "both", name, start + records + again + later)
  assert timeline.last_start(str(tmp_path / "both")) == 150.0
  latest, left_out = timeline.merge(str(tmp_path / "both"))
  alone, _ = timeline.merge(str(second))
  assert latest == alone and left_out == 3 + 3 + 4
  both, left_out = timeline.merge(str(tmp_path / "both"), all_runs=True)
  assert left_out == 0 and both["worker1"]["steps"] == 8
  done = subprocess.run(
      [sys.executable, "-m", "sync_replicas.timeline",
       str(tmp_path / "both")], capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=support.pythonpath(ROOT)))
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith(
      "the latest run only: 10 records of earlier runs in %s left out "
      "(--all merges them)\n" % (tmp_path / "both")), done.stdout


def test_merge_command_on_a_directory_without_timeline(tmp_path):
  done = subprocess.run(
      [sys.executable, "-m", "sync_replicas.timeline", str(tmp_path)],
      capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=support.pythonpath(ROOT)))
  assert done.returncode == 1
  assert done.stderr.startswith("sync-replicas-timeline: no timeline files")
  assert done.stderr.count("\n") == 1, done.stderr


def test_merge_command_on_a_missing_directory(tmp_path):
  # It said "no timeline files" (issue 46): the directory is not there.
  done = subprocess.run(
      [sys.executable, "-m", "sync_replicas.timeline", str(tmp_path / "no")],
      capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=support.pythonpath(ROOT)))
  assert done.returncode == 2, done
  assert done.stderr == (
      "sync-replicas-timeline: no such directory: %s. Pass the timeline_dir "
      "the job's tasks wrote to (the examples: their --timeline_dir).\n"
      % (tmp_path / "no")), done.stderr
  assert not (tmp_path / "no").exists()


def test_writer_drops_what_does_not_fit_and_never_blocks(tmp_path,
                                                         monkeypatch, caplog):
  monkeypatch.setattr(_timeline_writer, "MAX_PENDING", 3)
  writer = _timeline_writer.TimelineWriter(str(tmp_path / "t.jsonl"))
  # Hold the writer thread's file open call back: records pile up.
  gate = threading.Event()
  real_makedirs = os.makedirs
  monkeypatch.setattr(_timeline_writer.os, "makedirs",
                      lambda *a, **k: gate.wait(30) and real_makedirs(*a, **k))
  for i in range(10):
    writer.record(i=i)  # Returns at once even when the queue is full.
  gate.set()
  with caplog.at_level(logging.WARNING, logger=_timeline_writer.__name__):
    writer.close()
  records = [json.loads(line) for line in
             (tmp_path / "t.jsonl").read_text().splitlines()]
  assert records[0]["kind"] == "start"
  # What fitted (one may have left the queue).
  assert 3 <= len(records[1:]) <= 4, records
  assert "records dropped" in caplog.text


def test_writer_logs_a_failed_disk_once_and_goes_on(tmp_path, caplog):
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("")
  writer = _timeline_writer.TimelineWriter(str(blocker / "t.jsonl"))
  with caplog.at_level(logging.WARNING, logger=_timeline_writer.__name__):
    for i in range(5):
      writer.record(i=i)
    writer.close()
    writer.record(i=6)  # After a failure: dropped, no error.
  assert caplog.text.count("cannot write") == 1


def test_timeline_dir_is_checked_and_read_from_the_environment(monkeypatch):
  with pytest.raises(ValueError, match="timeline_dir must be a directory"):
    sync_replicas.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1),
        replicas_to_aggregate=1, timeline_dir=3)
  monkeypatch.setenv(_timeline.ENV, "/tmp/from_env")
  opt = sync_replicas.SyncReplicasOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1),
      replicas_to_aggregate=1)
  assert opt.options.timeline_dir == "/tmp/from_env"
  monkeypatch.delenv(_timeline.ENV)
  opt = sync_replicas.SyncReplicasOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1),
      replicas_to_aggregate=1)
  assert opt.options.timeline_dir is None


def _graph_ops(timeline_dir):
  with tf.Graph().as_default() as g:
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        ps_tasks=1, worker_device="/job:worker/task:0")):
      gs = tf.compat.v1.train.get_or_create_global_step()
      w = tf.compat.v1.get_variable("w", initializer=tf.constant([1.0, 2.0]))
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1),
          replicas_to_aggregate=1, timeline_dir=timeline_dir)
      opt.minimize(tf.reduce_sum(w * w), global_step=gs)
    return {op.name: (op.type, op.device, sorted(i.name for i in op.inputs),
                      sorted(c.name for c in op.control_inputs))
            for op in g.get_operations()}


def test_a_timeline_adds_ops_only_in_our_scope(tmp_path):
  plain, timed = _graph_ops(None), _graph_ops(str(tmp_path))
  added = set(timed) - set(plain)
  assert added and all(n.startswith("sync_replicas_status/timeline/")
                       for n in added), sorted(added)
  assert {n: timed[n] for n in plain} == plain


def test_only_runs_of_the_train_op_are_recorded(tmp_path):
  """Fetching the marks in a run that does not train would push and take a
  token; the hook adds them only where the train op runs. One worker,
  replicas_to_aggregate=1: its second push is stale (its token, the chief's
  initial one, carried step 0), as with stock."""
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=cluster.cluster_spec, worker_device="/job:worker/task:0")):
      gs = tf.compat.v1.train.get_or_create_global_step()
      w = tf.compat.v1.get_variable("w", initializer=tf.constant([1.0, 2.0]))
      loss = tf.reduce_sum(w * w)
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1),
          replicas_to_aggregate=1, timeline_dir=str(tmp_path),
          # Stock's start: its initial token makes the stale push below.
          data_end="stock")
      train_op = opt.minimize(loss, global_step=gs)
      # As tf-slim's train op: the loss behind a dependency on ours.
      with tf.control_dependencies([train_op]):
        slim_style = tf.identity(loss)
      grouped = tf.group(train_op, gs.read_value())
    runs = opt.timeline.runs_train_op
    assert not runs(gs) and not runs(loss) and not runs([loss, {"g": gs}])
    assert runs(train_op) and runs(slim_style) and runs(grouped)
    assert runs([loss, {"op": train_op}])
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=cluster.worker_targets[0], is_chief=True,
        hooks=[opt.make_session_run_hook(True)],
        config=support.session_config(), stop_grace_period_secs=2,
        log_step_count_steps=None) as sess:

      def settle(step):
        support.wait_until(lambda: sess.run(gs) == step, timeout=30,
                           what="global step %d" % step)
      sess.run(train_op)
      settle(1)
      for _ in range(3):
        sess.run([gs, loss])  # Recorded, these would push and take tokens.
      sess.run(slim_style)  # Stale: pushed at step 0.
      settle(1)
      sess.run([loss, {"op": train_op}])
      settle(2)
  _timeline_writer.close_all()
  start, *worker = [json.loads(line) for line in
                    (tmp_path / "worker0.worker.jsonl").read_text().splitlines()]
  assert start["kind"] == "start" and start["began"] <= worker[0]["began"]
  assert [(r["step"], r["got"]) for r in worker] == [(0, 0), (0, 1), (1, 2)]
  for r in worker:
    assert r["began"] <= r["grads"] <= r["pushed"] <= r["token"], r
  start, *chief = [json.loads(line) for line in
                   (tmp_path / "worker0.chief.jsonl").read_text().splitlines()]
  assert start["kind"] == "start"
  assert [r["step"] for r in chief] == [1, 2]
  for r in chief:
    assert r["began"] <= r["taken"] <= r["applied"] <= r["released"], r
  updates, steps, _ = timeline.aligned(*timeline.read(str(tmp_path))[:2])
  assert [s.stale for s in steps] == [False, True, False]


#: Bounds for the process cluster: start (TensorFlow's import, seconds of
#: CPU each) and training; far above what a loaded 2-core machine needs.
START_SECS = 120
TRAIN_SECS = 180


def test_the_trace_of_a_cluster_names_its_slow_worker(tmp_path):
  """3 workers, the third with 0.25 s in its input each step, 12 updates of
  all three: every update waits for it, and the merged trace says so from
  its events alone (pushes against each update's takes)."""
  hosts = ["%s:%d" % (LOOPBACK, p) for p in free_ports(4)]
  ready = tmp_path / "ready"
  ready.mkdir()
  spec = {"cluster": {"ps": hosts[:1], "worker": hosts[1:]},
          "timeline_dir": str(tmp_path / "timeline"), "slow_task": 2,
          "delay_secs": 0.25, "last_step": 12, "ready_dir": str(ready)}
  (tmp_path / "spec.json").write_text(json.dumps(spec))
  env = dict(os.environ, PYTHONPATH=support.pythonpath(ROOT),
             PYTHONUNBUFFERED="1")
  procs, logs = [], []

  def start(job, task):
    log = open(tmp_path / ("%s-%d.log" % (job, task)), "wb")
    logs.append(log)
    # Forked from the fork server (support.start_task).
    procs.append(support.start_task(
        [sys.executable, str(TASK), str(tmp_path / "spec.json"), job,
         str(task)], env=env, stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True))
    return procs[-1]

  def tails():
    return "\n".join("--- %s\n%s" % (p.name, p.read_text()[-2000:])
                     for p in sorted(tmp_path.glob("*.log")))
  try:
    start("ps", 0)
    chief = start("worker", 0)
    support.wait_until(lambda: (ready / "worker-0").exists()
                       or chief.poll() is not None, timeout=START_SECS,
                       what="the chief's session")
    assert chief.poll() is None, tails()
    workers = [chief] + [start("worker", t) for t in (1, 2)]
    for p in workers:
      try:
        assert p.wait(timeout=TRAIN_SECS) == 0, tails()
      except subprocess.TimeoutExpired:
        raise AssertionError("a worker still runs after %d s\n%s"
                             % (TRAIN_SECS, tails())) from None
  finally:
    for p in procs:
      support.kill_group(p)
    for log in logs:
      log.close()
  out = tmp_path / "trace.json"
  rows, _ = timeline.merge(spec["timeline_dir"], out=str(out),
                        png=str(tmp_path / "last.png"))
  events = json.loads(out.read_text())["traceEvents"]
  name = {e["pid"]: e["args"]["name"] for e in events
          if e["ph"] == "M" and e["name"] == "process_name"}
  takes = {e["args"]["global_step"]: e["ts"] + e["dur"] for e in events
           if e["name"] == "wait for gradients"}
  pushes = [e for e in events if e["name"] == "push"]
  last = {}
  for step, taken in takes.items():
    # The last fresh push for this update to begin before its takes
    # returned (a push's end is when its worker heard back, one hop late).
    began = [e for e in pushes if e["args"]["global_step"] == step - 1
             and e["ts"] <= taken]
    if began:
      last[step] = name[max(began, key=lambda e: e["ts"])["pid"]]
  assert len(last) >= 8, (takes, rows)
  # The first updates wait for whichever worker started last (each starts
  # after the chief, importing TensorFlow); from the 4th on, all three had
  # pushed, and the slow one is what they wait for. Two thirds, not all: a
  # fast worker descheduled for more than 0.25 s on a loaded machine is
  # then the last for that update.
  steady = {s: task for s, task in last.items() if s >= 4}
  slow = [s for s, task in steady.items() if task == "worker2"]
  assert len(slow) * 3 >= len(steady) * 2, (last, rows)
  assert all(e["args"]["waited_for"] == "worker2" for e in events
             if e["name"].startswith("update to step")
             and e["args"]["global_step"] in slow)
  assert timeline.straggler(rows) == "worker2"
  fast_wait = min(rows["worker0"]["median_token_wait_ms"],
                  rows["worker1"]["median_token_wait_ms"])
  assert fast_wait > 4 * rows["worker2"]["median_token_wait_ms"], rows
  assert (tmp_path / "last.png").read_bytes()[:4] == b"\x89PNG"


def _rows(**waited_and_stale):
  return {task: {"waited_for_last": w, "steps": 100, "stale_pushes": s}
          for task, (w, s) in waited_and_stale.items()}


@pytest.mark.parametrize("rows, says, not_says", [
    # Issue 46: a healthy run's title named the chief as the one waited for,
    # and nothing said that this is no fault.
    (_rows(**{"chief0": (55, 9), "worker0": (20, 11), "worker1": (25, 5)}),
     "each update's last needed push came from chief0 in 55, worker1 in "
     "25, worker0 in 20 of 100", "straggler"),
    (_rows(**{"chief0": (5, 0), "worker0": (90, 0), "worker1": (5, 0)}),
     "worker0 is the straggler the others wait for", "dropped"),
    # With a backup: the fast replicas complete the updates, the slow one's
    # pushes are dropped, and no straggler is named.
    (_rows(**{"chief0": (80, 0), "worker0": (0, 100), "worker1": (20, 0)}),
     "\ntoo late and dropped, which backups allow: most pushes of worker0 "
     "(100 of 100)", "straggler"),
], ids=["healthy", "straggler", "backup"])
def test_the_pictures_title_says_what_the_waits_mean(rows, says, not_says):
  title = timeline.headline(rows, 20, 100)
  assert title.startswith("last 20 of 100 updates\n"), title
  assert says in title and not_says not in title, title

"""A worker lost for good (issue 44): named at once in the chief's stall line.

The cluster is real: a ps and the chief are in-process servers; worker 1's
address is a listening socket that never answers (the kernel accepts its
connections, as for a SIGSTOPped task) and worker 2's a port where nothing
listens (a task that died). Each recorded its address on the ps at its
session's start, as our hook does, before it was lost.

The op-timeout test runs README's program as processes instead (1 ps, 3
workers, ``tests/lost_task.py``), stock's class and ours side by side, with
worker 2 SIGKILLed: what ends the chief is the error the user sees.
"""

import io
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import time
import types

import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import _lost
from sync_replicas import _ports
from sync_replicas import _step_record

STALL_LOG_SECS = 0.3
#: Past the first stall line, which probes for up to about 4 s.
STALL_TIMEOUT_SECS = 8


@pytest.fixture(name="lost_cluster")
def _lost_cluster(monkeypatch):
  silent = socket.socket()
  silent.bind(("127.0.0.1", 0))
  silent.listen(16)  # Never accepted: connections wait in the backlog.
  ports = sync_replicas.cluster.free_ports(3)
  spec = {"ps": ["127.0.0.1:%d" % ports[0]],
          "worker": ["127.0.0.1:%d" % ports[1],
                     "127.0.0.1:%d" % silent.getsockname()[1],
                     "127.0.0.1:%d" % ports[2]]}
  cluster = tf.train.ClusterSpec(spec)
  ps = tf.distribute.Server(cluster, job_name="ps", task_index=0)
  chief = tf.distribute.Server(cluster, job_name="worker", task_index=0)
  # Where each worker's hook finds its own address (task_address).
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec}))
  try:
    yield types.SimpleNamespace(spec=spec, ps=ps, target=chief.target,
                                worker_targets=[chief.target] * 3)
  finally:
    silent.close()


def _config():
  # The chief's session must not wait for the lost tasks (README's filters).
  return tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=support.OP_TIMEOUT_MS,
      device_filters=["/job:ps", "/job:worker/task:0"])


def _stall_lines(caplog):
  return [r.getMessage() for r in caplog.records
          if "no update for" in r.getMessage()]


def test_stall_line_names_each_worker_that_cannot_push_and_why(
    lost_cluster, caplog, tmp_path):
  caplog.set_level(logging.WARNING, logger="sync_replicas")
  chief = support.LinearWorker(
      support.OURS, lost_cluster, 0, replicas=3, total=3,
      opt_kwargs={"stall_log_secs": STALL_LOG_SECS,
                  "stall_timeout_secs": STALL_TIMEOUT_SECS})
  chief.opt.write_sync_manifest(str(tmp_path))
  status = []
  stopped = []
  try:
    with chief.graph.as_default(), \
        tf.compat.v1.train.MonitoredTrainingSession(
            master=lost_cluster.target, is_chief=True, hooks=[chief.hook],
            config=_config(), stop_grace_period_secs=1,
            save_summaries_steps=None, save_summaries_secs=None,
            log_step_count_steps=None) as sess:
      # Workers 1 and 2 each started once and recorded their address (their
      # hook's record_task_address, whose table this writes), then were lost.
      _record_addresses(lost_cluster.target, {
          1: lost_cluster.spec["worker"][1], 2: lost_cluster.spec["worker"][2]})
      # sync-replicas-status, run while the chief's step waits.
      status.append(support.BoundedThread(
          lambda: _status_once(tmp_path, lost_cluster.spec["ps"][0]),
          name="status"))
      status[0].start()
      sess.run(chief.train_op)  # Pushes at step 0, waits for a token.
  except sync_replicas.SyncStallError as e:
    stopped.append(str(e))
  line = [x for x in _stall_lines(caplog) if "cannot push" in x][0]
  spec = lost_cluster.spec
  assert "the update lacks 2 gradient(s); 2 worker(s) cannot push" in line
  assert ("worker1 at %s: its task " % spec["worker"][1]) in line, line
  assert "does not answer" in line.split("worker1 at")[1], line
  assert ("worker2 at %s: %s" % (spec["worker"][2], _lost.REFUSED)) in line, (
      line)
  assert "worker0 at" not in line  # The chief pushed; its task answers.
  # The job's end names them too.
  assert stopped and "cannot push" in stopped[0], stopped
  # So does sync-replicas-status, from its own reads and probes.
  text = status[0].finish(timeout=60)
  assert ("worker2 at %s: %s" % (spec["worker"][2], _lost.REFUSED)) in text, (
      text)
  assert "worker1 at " in text, text


def _status_once(manifest_dir, ps):
  """sync-replicas-status's output once it names a worker that cannot push
  (the chief's push may land a moment after the tool starts)."""
  from sync_replicas.cli import status as status_tool  # pylint: disable=g-import-not-at-top
  out = io.StringIO()
  support.wait_until(
      lambda: status_tool.main(["--manifest", str(manifest_dir), "--ps", ps],
                               out=out) == 0 and "cannot push" in
      out.getvalue(), timeout=30, what="sync-replicas-status naming them")
  return out.getvalue()


def _record_addresses(target, addresses):
  with tf.Graph().as_default() as graph, tf.compat.v1.device(
      "/job:ps/task:0"):
    table = tf.raw_ops.MutableHashTableV2(
        shared_name="sync_replicas_local_steps_addresses",
        use_node_name_sharing=False, key_dtype=tf.int64,
        value_dtype=tf.string)
    insert = tf.raw_ops.LookupTableInsertV2(
        table_handle=table, keys=tf.constant(list(addresses), tf.int64),
        values=tf.constant(list(addresses.values())))
  with tf.compat.v1.Session(target, graph=graph, config=_config()) as sess:
    sess.run(insert)


@pytest.mark.parametrize("target,environ,want", [
    ("grpc://localhost:2225", {}, "%s:2225" % socket.gethostname()),
    (b"grpc://10.0.0.7:2225", {}, "10.0.0.7:2225"),
    ("grpc://localhost:2225",
     {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2"]}})},
     "b:2"),
    ("", {}, None),
], ids=["localhost", "bytes", "tf-config", "in-process"])
def test_a_worker_knows_its_task_address(target, environ, want):
  assert _step_record.task_address(
      target, "/job:worker/task:1", environ=environ) == want


def test_the_clause_names_each_worker_that_cannot_push_by_its_task():
  # As the launcher labels its lines; "key N" only where no task is known.
  text = _lost.clause([
      (0, "/job:chief/replica:0/task:0", "10.0.0.1:2223", _lost.REFUSED),
      (2, "/job:worker/replica:0/task:1", None, _lost.SILENT),
      (7, None, None, "its address x cannot be reached")], missing=2)
  assert text == (
      "; the update lacks 2 gradient(s); 3 worker(s) cannot push: chief0 at "
      "10.0.0.1:2223: %s; worker1: %s; key 7 (task unknown): its address x "
      "cannot be reached" % (_lost.REFUSED, _lost.SILENT)), text


def test_probe_tells_refused_from_silent():
  silent = socket.socket()
  silent.bind(("127.0.0.1", 0))
  silent.listen(1)
  try:
    assert _lost.probe_address(
        "127.0.0.1:%d" % silent.getsockname()[1]) is None
    refused = "127.0.0.1:%d" % sync_replicas.cluster.free_ports(1)[0]
    assert _lost.probe_address(refused) == _lost.REFUSED
    assert "does not resolve" in _lost.probe_address("no-such-host.invalid:1")
  finally:
    silent.close()


LOST_TASK = pathlib.Path(__file__).with_name("lost_task.py")
#: The sessions' operation timeout in the op-timeout test: past the longest
#: step on the shared machine, short for the test's time.
TIMEOUT_MS = 12_000


class Readme:
  """README's program as 1 ps and 3 worker processes (``lost_task.py``),
  with stock's class or ours, every update averaging all 3 gradients;
  ``env``: more of the tasks' environment.

  The chief starts last, once the others' servers are up: its sync loop's
  first take starts with its session, and the first update needs every
  worker's first gradient, so a worker still importing TensorFlow when the
  short operation timeout runs out would end the job at its start.
  """

  def __init__(self, tmp_path, impl, *, steps=100_000, env=None):
    self._dir = tmp_path / impl
    self._dir.mkdir()
    ports = _ports.free_ports(4)
    self.cluster = {"ps": ["127.0.0.1:%d" % ports[0]],
                    "worker": ["127.0.0.1:%d" % p for p in ports[1:]]}
    self._spec = {"cluster": self.cluster, "impl": impl, "replicas": 3,
                  "steps": steps, "op_timeout_ms": TIMEOUT_MS}
    self.procs = {}
    copy = [p for p in [os.environ.get("SYNC_REPLICAS_KNOCKOUT_COPY")] if p]
    self._env = dict(os.environ, PYTHONPATH=support.pythonpath(
        *copy, LOST_TASK.parents[1]), **(env or {}))
    for job, task in [("ps", 0), ("worker", 1), ("worker", 2)]:
      self._start(job, task)
    for job, task in [("ps", 0), ("worker", 1), ("worker", 2)]:
      address = self.cluster[job][task]
      support.wait_until(lambda a=address: _lost.probe_address(a) is None,
                         timeout=120, what="%s%d's server" % (job, task),
                         interval=0.1)
    self._start("worker", 0)

  def _start(self, job, task):
    spec = dict(self._spec, job=job, task=task,
                out=str(self._dir / ("%s%d.jsonl" % (job, task))))
    with open(self._dir / ("%s%d.log" % (job, task)), "ab") as log:
      self.procs[(job, task)] = subprocess.Popen(
          [sys.executable, str(LOST_TASK), json.dumps(spec)], stdout=log,
          stderr=subprocess.STDOUT, env=self._env, start_new_session=True)

  def records(self, task, job="worker"):
    path = self._dir / ("%s%d.jsonl" % (job, task))
    if not path.exists():
      return []
    found = []
    for line in path.read_text().splitlines():
      try:
        found.append(json.loads(line))
      except ValueError:  # A line still being written.
        break
    return found

  def step(self):
    steps = [r["step"] for r in self.records(0) if r["event"] == "step"]
    return steps[-1] if steps else -1

  def end(self, task, job="worker"):
    ends = [r for r in self.records(task, job)
            if r["event"] in ("done", "error")]
    return ends[0] if ends else None

  def log(self, task, job="worker"):
    return (self._dir / ("%s%d.log" % (job, task))).read_text(
        errors="replace")

  def close(self):
    for proc in self.procs.values():
      support.kill_group(proc)


@pytest.mark.timeout(240)
def test_op_timeout_names_the_lost_worker_where_stock_says_only_timed_out(
    tmp_path):
  jobs = {impl: Readme(tmp_path, impl) for impl in ("stock", "ours")}
  try:
    for impl, job in jobs.items():
      support.wait_until(lambda j=job: j.step() >= 20, timeout=120,
                         what="%s's chief past step 20" % impl, interval=0.1)
    killed = {}
    for impl, job in jobs.items():
      support.kill_group(job.procs[("worker", 2)])
      killed[impl] = time.time()
    for impl, job in jobs.items():
      support.wait_until(lambda j=job: j.end(0) is not None,
                         timeout=TIMEOUT_MS / 1000 + 90,
                         what="%s's chief to end" % impl, interval=0.1)
    ends = {impl: job.end(0) for impl, job in jobs.items()}
    address = jobs["ours"].cluster["worker"][2]
    # Stock: the bare timeout, nothing about the lost worker.
    stock = ends["stock"]
    assert stock["event"] == "error" and stock["deadline"], stock
    assert jobs["stock"].cluster["worker"][2] not in stock["message"], stock
    # Ours: an error stock's except clause still catches, naming worker 2,
    # its address and why, and what to do; before the operation timeout.
    ours = ends["ours"]
    assert ours["event"] == "error", (ours, jobs["ours"].log(0)[-3000:])
    assert ours["type"] == "SyncTimeoutError" and ours["deadline"], ours
    assert ours["message"].startswith("Operation timed out: no update for ")
    assert ("worker2 at %s: %s" % (address, _lost.REFUSED)) in (
        ours["message"]), ours["message"]
    assert "worker_gone_secs" in ours["message"], ours["message"]
    lead = _lost.timeout_lead(TIMEOUT_MS / 1000)
    print("stock's chief: %s: %s" % (stock["type"], stock["message"][:300]))
    print("ours' chief, %.1f s after the kill (timeout %d ms, lead %.0f s): "
          "%s: %s" % (ours["t"] - killed["ours"], TIMEOUT_MS, lead,
                      ours["type"], ours["message"]))
    # Worker 1 ends too, at once: the chief closed the token queue.
    for impl, job in jobs.items():
      support.wait_until(lambda j=job: j.end(1) is not None, timeout=60,
                         what="%s's worker 1 to end" % impl, interval=0.1)
      print("%s's worker 1: %s" % (impl, job.end(1)))
  finally:
    for job in jobs.values():
      job.close()


@pytest.mark.timeout(180)
def test_chief_lost_for_good_ends_every_worker_with_an_error_naming_it(
    tmp_path):
  job = Readme(tmp_path, "ours")
  try:
    support.wait_until(lambda: job.step() >= 20, timeout=120,
                       what="the chief past step 20", interval=0.1)
    support.kill_group(job.procs[("worker", 0)])
    killed = time.time()
    address = job.cluster["worker"][0]
    for task in (1, 2):
      support.wait_until(lambda t=task: job.end(t) is not None,
                         timeout=TIMEOUT_MS / 1000 + 60,
                         what="worker %d to end" % task, interval=0.1)
      end = job.end(task)
      assert end["event"] == "error", (end, job.log(task)[-3000:])
      # Stock's error type, at stock's time (the run's own timeout), with
      # the chief named: its task, its address and why.
      assert end["type"] == "SyncTimeoutError" and end["deadline"], end
      assert ("the chief, worker0 at %s, cannot: %s" % (
          address, _lost.REFUSED)) in (
                  end["message"]), end["message"]
      took = end["t"] - killed
      assert took < TIMEOUT_MS / 1000 + 30, took
      print("worker %d, %.1f s after the chief's kill: %s: %s" % (
          task, took, end["type"], end["message"]))
  finally:
    job.close()

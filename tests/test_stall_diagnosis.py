"""A stalled update says why: workers' local steps against the global step.

Issue 16: a stall whose every push was stale printed "update to step 2 waits
for gradients: ... 0/2", which points away from the cause. The stall line
(and ``sync-replicas-status``) now lists every replica's local step, says which
pushes are stale, and names the likely cause where it can be detected.
"""

import io
import json
import logging
import socket
import threading
import types

import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import _diagnose
from sync_replicas import _stall_watch

STALL_LOG_SECS = 0.3


def _stall_lines(caplog):
  return [r.getMessage() for r in caplog.records
          if "no update for" in r.getMessage()]


class _OneReplica:
  """One replica on a local server, its session started by hand."""

  def __init__(self, *, run_chief_init):
    self.server = tf.distribute.Server.create_local_server()
    self.graph = tf.Graph()
    with self.graph.as_default():
      self.global_step = tf.compat.v1.train.get_or_create_global_step()
      v = tf.compat.v1.Variable([1.0, 2.0], name="v")
      self.opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1),
          replicas_to_aggregate=1, stall_log_secs=STALL_LOG_SECS,
          # Stock's start, whose spare initial token the steps below use.
          data_end="stock")
      self.train_op = self.opt.minimize(tf.reduce_sum(v * v),
                                        global_step=self.global_step)
      self.local_step = support.local_step_variable(self.graph)
      self.rewind_global = self.global_step.assign(0)
      self.rewind_local = self.local_step.assign(0)
      init = [tf.compat.v1.global_variables_initializer(),
              tf.compat.v1.local_variables_initializer()]
      tokens = self.opt.get_init_tokens_op()
    self.sess = tf.compat.v1.Session(self.server.target, graph=self.graph,
                                     config=support.session_config())
    self.sess.run(init)
    if run_chief_init:
      self.sess.run(self.opt.chief_init_op)
    self.sess.run(tokens)
    self.coord = tf.compat.v1.train.Coordinator()
    self.threads = self.opt.get_chief_queue_runner().create_threads(
        self.sess, coord=self.coord, daemon=True, start=True)

  def step(self, want):
    self.sess.run(self.train_op)
    support.wait_until(lambda: self.sess.run(self.global_step) >= want,
                       timeout=30, what="global step %d" % want)

  def blocked_step(self):
    """A train step that will block in the token dequeue (bounded)."""
    options = tf.compat.v1.RunOptions(timeout_in_ms=20_000)
    thread = support.BoundedThread(
        lambda: self.sess.run(self.train_op, options=options),
        name="blocked-step")
    thread.start()
    return thread

  def close(self):
    self.coord.request_stop()
    self.coord.join(self.threads, stop_grace_period_secs=10)
    self.sess.close()


def _wait_for_stall_line(caplog, needle):
  support.wait_until(
      lambda: any(needle in line for line in _stall_lines(caplog)),
      timeout=20, what="a stall line containing %r" % needle)
  return [line for line in _stall_lines(caplog) if needle in line][-1]


def test_stall_line_says_every_push_is_stale(caplog):
  caplog.set_level(logging.WARNING, logger="sync_replicas")
  replica = _OneReplica(run_chief_init=True)
  try:
    for want in (1, 1, 2, 3):
      replica.step(want)
    # A worker holding an old step: its pushes are dropped, no token comes.
    replica.sess.run(replica.rewind_local)
    blocked = replica.blocked_step()
    line = _wait_for_stall_line(caplog, "is stale")
    assert "update to step 4 waits for gradients: v 0/1; 0 token(s)" in line
    assert "workers' local steps: this replica 0" in line
    assert ("every push from this replica is stale (local step behind global "
            "step 3) and dropped: no worker can push a fresh gradient and no "
            "token is queued, so no update can happen") in line
  finally:
    replica.close()
  with pytest.raises(tf.errors.OpError):  # Closed queue or its own timeout.
    blocked.finish(timeout=30)


def test_stall_line_names_a_global_step_that_went_back_without_chief_init_op(
    caplog):
  """Inception-style start (no chief_init_op), then the global step goes
  back as a restore would: the accumulator stays ahead, every push after
  that is dropped although the worker holds the newest token."""
  caplog.set_level(logging.WARNING, logger="sync_replicas")
  replica = _OneReplica(run_chief_init=False)
  try:
    for want in (1, 1, 2, 3):
      replica.step(want)
    replica.sess.run(replica.rewind_global)
    replica.step(1)  # Local step 3 is not behind the accumulator: applied.
    blocked = replica.blocked_step()  # Local step 1, accumulator at 4.
    line = _wait_for_stall_line(caplog, "ahead of the global step")
    assert "workers' local steps: this replica 1" in line
    assert "chief_init_op never ran on this ps" in line
  finally:
    replica.close()
  with pytest.raises(tf.errors.OpError):
    blocked.finish(timeout=30)


def test_stall_line_reads_every_replica_task(caplog):
  """Against a cluster, each replica task's own local step is read."""
  caplog.set_level(logging.WARNING, logger="sync_replicas")
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  chief = support.LinearWorker(support.OURS, cluster, 0, replicas=2, total=2,
                               opt_kwargs={"stall_log_secs": STALL_LOG_SECS,
                                           "data_end": "stock"})
  with chief.session() as sess:
    sess.run(chief.train_op)  # Pushes at step 0; worker 1 never starts.
    line = _wait_for_stall_line(caplog, "local steps")
  assert "update to step 1 waits for gradients: w 1/2" in line
  assert "local steps: worker0 0, worker1 not started" in line
  assert "stale" not in line


def test_reading_a_dead_task_is_bounded():
  """A read placed on a task that is down never returns by itself."""
  ports = sync_replicas.cluster.free_ports(2)
  spec = tf.train.ClusterSpec({"worker": ["127.0.0.1:%d" % p for p in ports]})
  alive = tf.distribute.Server(spec, job_name="worker", task_index=0)
  reader = _diagnose.LocalStepReader(
      _diagnose.LocalStepSpec("sync_rep_local_step", "int64", True, ""),
      timeout_secs=1.0)
  devices = ["/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"]
  done = threading.Event()
  found = []
  thread = support.BoundedThread(
      lambda: found.extend(reader.read(alive.target, devices)) or done.set())
  thread.start()
  thread.finish(timeout=20)
  assert found[0] == _diagnose.LocalStep(devices[0], None, "not started")
  assert found[1].step is None and found[1].error.startswith("unreachable")
  # A second read does not start a second thread for the blocked task.
  again = reader.read(alive.target, devices[1:])
  assert again[0].error == "unreachable (an earlier read still waits)"


def test_the_stall_line_reads_a_task_whose_address_is_known_through_it(
    monkeypatch):
  """Without the record on the ps (``data_end="stock"``), the stall line
  reads each task's local step; one whose address is known (recorded, else
  TF_CONFIG's) through its own server, where every call is bounded: through
  the chief's master a read of a stopped task outlived its bound, and one
  that came back at exit aborted the process (issue 46)."""
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {
      "ps": ["127.0.0.1:2222"],
      "worker": ["127.0.0.1:2223", "127.0.0.1:2224", "127.0.0.1:2225"]}}))
  devices = ["/job:worker/replica:0/task:%d" % i for i in range(3)]
  asked = []

  class Reader:
    spec = _diagnose.LocalStepSpec("sync_rep_local_step", "int64", True,
                                   "/job:worker/task:0")

    def read(self, target, wanted, *, config=None, addresses=None):
      del config
      asked.append((target, wanted, addresses))
      return [_diagnose.LocalStep(d, 0, None) for d in wanted]

  sess = types.SimpleNamespace(
      sess_str="grpc://127.0.0.1:2223",
      list_devices=lambda: [types.SimpleNamespace(name=d + "/device:CPU:0")
                            for d in ["/job:ps/replica:0/task:0", *devices]])
  # Worker 1's recorded address wins over TF_CONFIG's.
  _stall_watch._read_local_steps(  # pylint: disable=protected-access
      sess, object(), Reader(), recorded={devices[1]: "10.0.0.2:2224"})
  assert asked == [("grpc://127.0.0.1:2223", devices, {
      devices[0]: "127.0.0.1:2223", devices[1]: "10.0.0.2:2224",
      devices[2]: "127.0.0.1:2225"})], asked


def test_a_stall_line_reads_the_recorded_addresses_once(monkeypatch):
  """With a record on the ps that holds no local step yet, both of the stall
  line's looks at the tasks use the addresses recorded there: each task's
  local step is read through its own server, and the workers that cannot
  push are probed there. The record is read once for both (it was read by
  each look, two runs on the ps per stall line)."""
  refused = "127.0.0.1:%d" % sync_replicas.cluster.free_ports(1)[0]
  devices = ["/job:worker/replica:0/task:%d" % i for i in range(3)]
  listening = socket.socket()
  listening.bind(("127.0.0.1", 0))
  listening.listen(8)
  answers = "127.0.0.1:%d" % listening.getsockname()[1]
  recorded = {0: "127.0.0.1:2223", 1: refused, 2: answers}
  read_addresses = []
  reads = []

  class Reader:

    def __init__(self, spec):
      self.spec = spec

    def read(self, target, wanted, *, config=None, addresses=None):
      del target, config
      reads.append((wanted, addresses))
      return [_diagnose.LocalStep(d, 7, None) for d in wanted]

  def read_record(sess):
    del sess
    read_addresses.append(1)
    return dict(recorded)

  ends = types.SimpleNamespace(
      done_keys="done_keys", total_num_replicas=3, key=0,
      devices=dict(enumerate(devices)), need=lambda done: 3 - done,
      local_steps=types.SimpleNamespace(
          read=lambda sess, done, gone: None,  # No train run recorded yet.
          read_addresses=read_record))
  sess = types.SimpleNamespace(
      sess_str="grpc://127.0.0.1:2223",
      run=lambda fetches: ([], []),  # The done record: nobody done.
      list_devices=lambda: [types.SimpleNamespace(name=d + "/device:CPU:0")
                            for d in ["/job:ps/replica:0/task:0", *devices]])
  monkeypatch.setattr(_stall_watch._diagnose, "LocalStepReader", Reader)  # pylint: disable=protected-access
  with tf.Graph().as_default(), tf.compat.v1.device("/job:worker/task:0"):
    local_step = tf.compat.v1.Variable(0, dtype=tf.int64,
                                       name="sync_rep_local_step")
  watch = _stall_watch.StallWatch(
      status=types.SimpleNamespace(names=["w"]),
      global_step=types.SimpleNamespace(dtype=tf.int64), replicas_to_aggregate=3,
      loop=types.SimpleNamespace(data_end=ends), local_step=local_step,
      stall_log_secs=1, stall_timeout_secs=None, updated_at=lambda: None,
      clock=lambda: 0.0)
  try:
    what, names_one = watch._verdict(  # pylint: disable=protected-access
        sess, types.SimpleNamespace(wait_for_stop=lambda secs: False),
        step=7, counts=[2], tokens=0, starts=1)
  finally:
    listening.close()
  assert read_addresses == [1], read_addresses
  by_device = dict(zip(devices, (recorded[k] for k in range(3)), strict=True))
  # Every task's local step, then worker 2's (worker 1 refuses: no read).
  assert reads == [(devices, by_device), ([devices[2]], by_device)], reads
  assert names_one, what
  assert ("1 worker(s) cannot push: worker1 at %s: its task refuses "
          "connections (down)" % refused) in what, what


@pytest.mark.parametrize("local, tokens, starts, want", [
    (5, 0, 1, "every push from w0 is stale (local step behind global step 7)"
              " and dropped: no worker can push"),
    (7, 0, 0, "accumulators' step is ahead of the global step"),
    (7, 0, 1, None),
    (5 + 2 ** 32, 0, 3, "w0 5 (generation 1, current 2)"),
], ids=["stale", "ahead-no-chief-init", "fresh", "older-generation"])
def test_verdict_text(local, tokens, starts, want):
  text = _diagnose.verdict(
      names=["v"], counts=[0], tokens=tokens, replicas_to_aggregate=1,
      global_step=7, starts=starts, generations=True,
      local_steps=[_diagnose.LocalStep("w0", local, None)])
  assert text.startswith("update to step 8 waits for gradients: v 0/1; "
                         "%d token(s) queued; workers' local steps: w0 "
                         % tokens)
  if want is None:
    assert "stale" not in text and "ahead" not in text
  else:
    assert want in text


def test_verdict_marks_the_workers_done_and_never_calls_them_stale():
  # Readings from the ps's record (data_end): a worker whose input ended
  # pushes no more, whatever its last local step.
  text = _diagnose.verdict(
      names=["v"], counts=[0], tokens=0, replicas_to_aggregate=1,
      global_step=7, starts=1, generations=True,
      local_steps=[_diagnose.LocalStep("key 0", 7, None),
                   _diagnose.LocalStep("key 1", 5, None, done=True),
                   _diagnose.LocalStep("key 2", None, "no step yet")])
  assert text.endswith("workers' local steps: key 0 7, key 1 5 (done), "
                       "key 2 no step yet"), text
  # From a job's task devices (every replica's record in a placed job),
  # each worker as every line names it: its job and index run together.
  text = _diagnose.verdict(
      names=["v"], counts=[0], tokens=0, replicas_to_aggregate=1,
      global_step=7, starts=1, generations=True,
      local_steps=[_diagnose.LocalStep("/job:chief/replica:0/task:0", 7, None),
                   _diagnose.LocalStep("/job:worker/replica:0/task:0", 5,
                                       None, done=True),
                   _diagnose.LocalStep("/job:worker/task:1", None,
                                       "no step yet")])
  assert text.endswith("workers' local steps: chief0 7, worker0 5 (done), "
                       "worker1 no step yet"), text


def test_status_tool_says_which_replicas_pushes_are_stale(tmp_path):
  """``sync-replicas-status`` reads the same local steps and prints the same
  words."""
  from sync_replicas.cli import status as status_tool  # pylint: disable=g-import-not-at-top
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  # Stock's start: its spare initial token makes the stale push.
  worker = support.LinearWorker(support.OURS, cluster, 0, replicas=1, total=1,
                                opt_kwargs={"data_end": "stock"})
  with worker.graph.as_default():
    local_step = support.local_step_variable(worker.graph)
    rewind = local_step.assign(0)
  worker.opt.write_sync_manifest(str(tmp_path))
  with worker.session() as sess:
    for want in (1, 1, 2, 3):
      sess.run(worker.train_op)
      support.wait_until(lambda: sess.run(worker.global_step) >= want,
                         timeout=30, what="global step %d" % want)
    sess.run(rewind)
    options = tf.compat.v1.RunOptions(timeout_in_ms=8_000)
    blocked = support.BoundedThread(
        lambda: sess.run(worker.train_op, options=options), name="blocked")
    blocked.start()
    out = io.StringIO()
    ps = cluster.cluster_spec.job_tasks("ps")[0]
    support.wait_until(
        lambda: status_tool.main(["--manifest", str(tmp_path), "--ps", ps],
                                 out=out) == 0 and "is stale" in out.getvalue(),
        timeout=20, what="sync-replicas-status to report the stale pushes")
    text = out.getvalue()
    assert ("replicas: workers' local steps: worker0 0; "
            "every push from worker0 is stale (local step "
            "behind global step 3) and dropped: no worker can push a fresh "
            "gradient and no token is queued, so no update can happen") in text
    with pytest.raises(tf.errors.OpError):
      blocked.finish(timeout=30)

"""A worker lost for good, with ``worker_gone_secs``, beside every option it
meets (issue 44, item 4), in process.

One in-process cluster (a ps and three workers) serves every test. Workers
are threads, each with its own graph and MonitoredSession on its own server.
The lost worker stops for good between two runs, as a killed process does,
and its task's address, the one its hook recorded on the ps (TF_CONFIG's
entry, as a launched task's is), relays to its real server while it trains
and is a port where nothing listens once it left: the chief's probe finds
it refused, as it finds a dead task's (test_gone proves the same with
SIGKILLed processes, test_gone_hosts with a host cut off).

Everything is counted from the applied updates, on the ps: each gradient a
worker pushes at local step s adds 1 to cell (s, worker) of ``counts`` (a
sparse gradient, summed by ``sparse_reduction="sum"``, at rate -1), so row
s of ``counts`` says how many gradients the update to step s + 1 took, and
from whom. The same push also carries a dense gradient, ``R * e[s, worker]``,
into ``trace`` (averaged by its dense or fused accumulator): its row s is
``R * counts[s] / counts[s].sum()`` when the dense take averaged the same
gradients.
"""

import functools
import json
import logging
import socket
import threading
import time
import types

import numpy as np
import pytest
import tensorflow as tf

import support

#: worker_gone_secs here: a refused probe answers at once, in process.
GONE_SECS = 1.0
#: Bound on a whole job of a few dozen steps on a loaded machine.
JOB_SECS = 120
#: A generation-encoded local step's plain step (int64 global steps).
STEP_MASK = (1 << 32) - 1
#: The lost worker's last push is at this local step - 1.
LOST_AT = 8
#: Updates after the chief's "is gone" line that may still be a transient:
#: tokens released for the lost worker before it was declared, which the
#: others use up with a push each (counted twice in an update, or stale).
TRANSIENT = 3
W = 3
#: Where the updates do not stop for the lost worker (backups, a deadline),
#: the job must last past worker_gone_secs after the loss, and past its
#: transient, whatever the machine's speed: pauses of 30 ms on average
#: before each push keep it under about 25 updates a second.
STEPS_ON = dict(last_step=100, delay=0.03)

SHARED = support.SharedCluster(num_workers=W, num_ps=1)


class Worker:
  """Worker ``task``: one or more sync optimizers (``names``), each pushing
  a sparse ``counts`` gradient and dense ``trace`` and ``w`` gradients.

  With ``batches``, its one-pass input ends after that many train runs
  (data_end); without, a step limit (``last_step``) ends the job.
  """

  def __init__(self, cluster, task, *, replicas, rows, names=(None,),
               batches=None, last_step=None, **opt_kwargs):
    self.task, self.rows, self.is_chief = task, rows, task == 0
    self.target = cluster.worker_targets[task]
    self.graph = tf.Graph()
    self.runs = 0
    self.parts = []
    with self.graph.as_default():
      if batches is not None:
        with tf.compat.v1.device("/job:worker/task:%d" % task):
          batch = tf.cast(tf.compat.v1.data.make_one_shot_iterator(
              tf.data.Dataset.range(batches)).get_next(), tf.float32)
        # Depends on the batch: a run whose input ended pushes nothing.
        zero = 0.0 * batch
      else:
        zero = tf.constant(0.0)
      for name in names:
        prefix = "" if name is None else name + "_"
        with tf.compat.v1.device("/job:ps/task:0"):
          if name is None:
            step = tf.compat.v1.train.get_or_create_global_step()
          else:
            step = tf.compat.v1.get_variable(
                prefix + "step", [], tf.int64, trainable=False,
                initializer=tf.zeros_initializer())
          counts = tf.compat.v1.get_variable(
              prefix + "counts", [rows, W], initializer=tf.zeros_initializer())
          trace = tf.compat.v1.get_variable(
              prefix + "trace", [rows, W], initializer=tf.zeros_initializer())
          w = tf.compat.v1.get_variable(
              prefix + "w", [2], initializer=tf.zeros_initializer())
        with tf.compat.v1.device("/job:worker/task:%d" % task):
          row = tf.compat.v1.placeholder(tf.int32, [], name=prefix + "row")
          mine = tf.one_hot(task, W) + zero
          kwargs = dict(opt_kwargs, sparse_reduction="sum")
          if name is not None:
            kwargs["name"] = name
          if kwargs.get("one_gradient_per_worker"):
            kwargs["worker_index"] = task
          opt = support.OURS(
              tf.compat.v1.train.GradientDescentOptimizer(-1.0),
              replicas_to_aggregate=replicas, total_num_replicas=W, **kwargs)
          train_op = opt.apply_gradients([
              (tf.IndexedSlices(tf.reshape(mine, [1, W]),
                                tf.reshape(row, [1]),
                                tf.constant([rows, W])), counts),
              (tf.tensordot(tf.one_hot(row, rows), mine * replicas, axes=0),
               trace),
              (tf.zeros([2]) + zero, w)], global_step=step)
        self.parts.append((opt, row, train_op, step))
      self.hooks = [opt.make_session_run_hook(self.is_chief)
                    for opt, _, _, _ in self.parts]
      if last_step is not None:
        self.hooks.append(tf.compat.v1.train.StopAtStepHook(
            last_step=last_step))

  def train(self, ready, *, lost_at=None, leave=None, delay=0.005,
            gate=None):
    """Trains until the input ends or the step limit; with ``lost_at``,
    leaves for good before its first push at that local step, calling
    ``leave()`` (its task's address then refuses connections); with
    ``gate`` (a ``Gate``), passes it before each push."""
    rng = np.random.default_rng(self.task)
    with self.graph.as_default(), support.monitored_session(
        self.target, is_chief=self.is_chief, hooks=self.hooks) as sess:
      if self.is_chief:
        ready.set()
      while not sess.should_stop():
        for opt, row, train_op, _ in self.parts:
          if sess.should_stop():  # The other optimizer's run saw the end.
            return self.runs
          local = int(sess.run(opt.local_step)) & STEP_MASK
          if sess.should_stop():  # That read may have seen the last step.
            return self.runs
          if lost_at is not None and local >= lost_at:
            leave()
            return self.runs
          if gate is not None:
            gate.pass_(self.task, local)
          # Random pauses shuffle who pushes last.
          time.sleep(rng.uniform(0, 2 * delay))
          sess.run(train_op, feed_dict={row: min(local, self.rows - 1)})
        self.runs += 1
    return self.runs


class Gate:
  """Holds each worker that passes it before its push at local step
  ``at`` or later, until ``open_to`` moves ``at`` past that step."""

  def __init__(self, at):
    self.at = at
    self.waiting = {}  # task -> the local step it waits at
    self._cond = threading.Condition()

  def pass_(self, task, local):
    deadline = time.monotonic() + JOB_SECS
    with self._cond:
      while local >= self.at:
        self.waiting[task] = local
        self._cond.notify_all()
        left = deadline - time.monotonic()
        if left <= 0:
          raise AssertionError("worker %d held at local step %d for %d s"
                               % (task, local, JOB_SECS))
        self._cond.wait(left)
      self.waiting.pop(task, None)
      self._cond.notify_all()

  def open_to(self, at):
    with self._cond:
      self.at = at
      self._cond.notify_all()

  def wait_for(self, tasks, local, *, also=lambda: False, timeout=JOB_SECS):
    """Until every one of ``tasks`` waits at ``local`` (True), or
    ``also()`` (False)."""
    deadline = time.monotonic() + timeout
    with self._cond:
      while not all(self.waiting.get(t) == local for t in tasks):
        if also():
          return False
        left = deadline - time.monotonic()
        assert left > 0, "workers %s not held at local step %d: %s" % (
            tasks, local, self.waiting)
        self._cond.wait(min(left, 0.05))
      return True


class TaskAddress:
  """A task's address as a port of its own that relays every connection to
  the task's real server (``upstream``, ``host:port``) until ``close``,
  after which connections to it are refused, as a dead task's are.

  The chief reads a task's local step through the address its hook
  recorded (the gone watch, the stall line: ``_diagnose.LocalStepReader``),
  so that address must answer as the task's own server does while it
  trains. Each connection is relayed, both ways, by two threads of its own
  until either side closes; ``close`` ends every one and joins them all
  with a deadline.
  """

  #: Bound on ``close``'s joins, in seconds.
  CLOSE_SECS = 10.0

  def __init__(self, upstream):
    host, _, port = upstream.rpartition(":")
    self._upstream = (host, int(port))
    self._listener = socket.socket()
    self._listener.bind(("127.0.0.1", 0))
    self._listener.listen(128)
    self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
    self._lock = threading.Lock()
    self._closed = False
    self._sockets, self._threads = [], []
    self._accepts = threading.Thread(target=self._accept, daemon=True,
                                     name="relay-accept")
    self._accepts.start()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _accept(self):
    while True:
      try:
        client, _ = self._listener.accept()
      except OSError:  # ``close`` shut the listener down.
        return
      try:
        server = socket.create_connection(self._upstream, timeout=5)
        server.settimeout(None)
      except OSError:
        client.close()  # The task's server is gone: so is this connection.
        continue
      with self._lock:
        if self._closed:
          client.close()
          server.close()
          return
        self._sockets += [client, server]
        for source, sink in ((client, server), (server, client)):
          thread = threading.Thread(target=_pump, args=(source, sink),
                                    daemon=True, name="relay")
          self._threads.append(thread)
          thread.start()

  def close(self):
    """From now on connections are refused; every relayed one is ended."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      sockets = list(self._sockets)
    # A listening socket shut down stops listening at once (new
    # connections are refused) and wakes the accept in flight.
    _shut(self._listener)
    for sock in sockets:
      _shut(sock)
    deadline = time.monotonic() + self.CLOSE_SECS
    with self._lock:
      threads = [self._accepts, *self._threads]
    for thread in threads:
      thread.join(max(deadline - time.monotonic(), 0.0))
    alive = [t.name for t in threads if t.is_alive()]
    self._listener.close()
    for sock in sockets:
      sock.close()
    assert not alive, "relay threads still running after %.0f s: %s" % (
        self.CLOSE_SECS, alive)


def _shut(sock):
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:  # Not connected (any more).
    pass


def _pump(source, sink):
  """Relays ``source`` to ``sink`` until either side closes, then ends the
  connection both ways (the other direction's thread then ends too)."""
  try:
    while True:
      data = source.recv(65536)
      if not data:
        break
      sink.sendall(data)
  except OSError:
    pass
  finally:
    _shut(source)
    _shut(sink)


def _tf_config(monkeypatch, cluster, worker2):
  """TF_CONFIG naming ``worker2`` as worker 2's address (its hook records
  that entry on the ps)."""
  spec = cluster.cluster_spec.as_dict()
  spec["worker"] = list(spec["worker"])
  spec["worker"][2] = worker2
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec}))


@pytest.fixture(name="lost")
def _lost(monkeypatch):
  """The shared cluster, and worker 2's address as its hook records it
  (TF_CONFIG's entry): a ``TaskAddress`` relaying to its real server while
  it trains (the probe's connection is accepted, and a read of its local
  step through that address answers), closed when it leaves, so that from
  then on its task refuses connections, as a dead task's does."""
  with SHARED.use() as cluster:
    with TaskAddress(cluster.cluster_spec.as_dict()["worker"][2]) as worker2:
      _tf_config(monkeypatch, cluster, worker2.address)
      yield types.SimpleNamespace(cluster=cluster, leave=worker2.close)


def _gone_lines(caplog):
  return [r.getMessage() for r in caplog.records
          if r.name.startswith("sync_replicas") and " is gone" in
          r.getMessage()]


def _read(cluster, jobs, name=None):
  """(global step, counts, trace) of optimizer ``name``, from the ps."""
  prefix = "" if name is None else name + "_"
  rows = jobs[0].rows
  with tf.Graph().as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      if name is None:
        step = tf.compat.v1.train.get_or_create_global_step()
      else:
        step = tf.compat.v1.get_variable(prefix + "step", [], tf.int64)
      counts = tf.compat.v1.get_variable(prefix + "counts", [rows, W])
      trace = tf.compat.v1.get_variable(prefix + "trace", [rows, W])
    with tf.compat.v1.Session(cluster.worker_targets[0],
                              config=support.session_config()) as sess:
      step, counts, trace = sess.run([step, counts, trace])
  return int(step), counts, trace


def _run(lost, caplog, *, replicas=W, last_step=None, batches=None,
         names=(None,), delay=0.005, **opt_kwargs):
  """One job; worker 2 leaves for good at local step LOST_AT.

  Returns (jobs, ``{name: its global step once the chief said worker 2 is
  gone}``): one line per optimizer.
  """
  cluster = lost.cluster
  caplog.set_level(logging.INFO, logger="sync_replicas")
  rows = (last_step or max(batches or [0])) + 16
  jobs = [Worker(cluster, t, replicas=replicas, rows=rows, names=names,
                 batches=None if batches is None else batches[t],
                 last_step=last_step, worker_gone_secs=GONE_SECS,
                 **opt_kwargs)
          for t in range(W)]
  ready = threading.Event()
  threads = [support.BoundedThread(
      functools.partial(jobs[t].train, delay=delay, **(
          dict(lost_at=LOST_AT, leave=lost.leave) if t == 2 else {})),
      ready, name="worker-%d" % t) for t in range(W)]
  threads[0].start()
  support.wait_until(lambda: ready.is_set() or not threads[0].is_alive(),
                     timeout=60, what="the chief's session")
  for t in threads[1:]:
    t.start()
  gone_at = {}
  try:
    support.wait_until(
        lambda: (len(_gone_lines(caplog)) >= len(names)
                 or not threads[0].is_alive()),
        timeout=JOB_SECS, what="the chief's lines declaring worker 2 gone",
        interval=0.05)
    if len(_gone_lines(caplog)) >= len(names):
      gone_at = {name: _read(cluster, jobs, name)[0] for name in names}
  finally:
    for t in threads:
      t.finish(timeout=JOB_SECS)
  assert gone_at, "worker 2 was not declared gone (%d optimizer(s)):\n%s" % (
      len(names), "\n".join(r.getMessage() for r in caplog.records))
  return jobs, gone_at


def _check_counts(counts, trace, *, replicas, step, gone_at, need=2,
                  exact_before=True):
  """After the chief said worker 2 is gone (and a transient), each update
  took ``need`` gradients, one of each of workers 0 and 1, and none of
  worker 2's ever again; with ``exact_before``, each update before it left
  took one of each worker."""
  assert step >= gone_at + TRANSIENT + 3, (step, gone_at)
  if exact_before:
    before = counts[:LOST_AT - 1]
    np.testing.assert_array_equal(before, np.ones_like(before),
                                  err_msg="before the loss")
  np.testing.assert_array_equal(counts[LOST_AT:, 2], 0)
  after = counts[gone_at + TRANSIENT:step]
  want = np.zeros_like(after)
  want[:, :need] = 1
  np.testing.assert_array_equal(after, want, err_msg=(
      "after worker 2 was declared gone (global step %d), rows %d on: %s"
      % (gone_at, gone_at + TRANSIENT, counts[:step].tolist())))
  # The dense (or fused) accumulator averaged the same gradients.
  rows = counts[gone_at + TRANSIENT:step]
  np.testing.assert_allclose(trace[gone_at + TRANSIENT:step],
                             replicas * rows / rows.sum(axis=1, keepdims=True),
                             rtol=1e-6)
  np.testing.assert_array_equal(counts[step:], 0)


@pytest.mark.parametrize("kwargs", [
    {},
    dict(fuse_dense_gradients=True),
    dict(one_gradient_per_worker=True),
], ids=["sparse_and_dense", "fused", "one_gradient_per_worker"])
def test_updates_take_one_gradient_of_each_live_worker_once_it_is_gone(
    lost, caplog, kwargs):
  jobs, gone_at = _run(lost, caplog, last_step=40, **kwargs)
  step, counts, trace = _read(lost.cluster, jobs)
  _check_counts(counts, trace, replicas=W, step=step, gone_at=gone_at[None])


def test_backups_stop_giving_the_lost_workers_tokens_to_the_others(
    lost, caplog):
  """R = 2 of 3: the updates never wait for the lost worker (the backup
  covers it), but its tokens went to the two others, one of which then
  pushed twice for an update. Declared gone, the chief releases two tokens
  per update: one gradient of each live worker."""
  jobs, gone_at = _run(lost, caplog, replicas=2, **STEPS_ON)
  step, counts, trace = _read(lost.cluster, jobs)
  _check_counts(counts, trace, replicas=2, step=step, gone_at=gone_at[None],
                exact_before=False)
  assert (counts[:LOST_AT - 1].sum(axis=1) >= 2).all(), counts[:LOST_AT]


def test_a_deadline_shorter_than_worker_gone_secs_still_lets_it_go(
    lost, caplog):
  """min_replicas_to_aggregate=2 with a deadline under worker_gone_secs:
  the first update without the lost worker goes ahead at the deadline,
  then its tokens let a survivor push twice, so the step never stops for
  worker_gone_secs. Declared gone all the same: from then on each update
  takes one gradient of each live worker, with no deadline wait."""
  jobs, gone_at = _run(lost, caplog, **STEPS_ON,
                       min_replicas_to_aggregate=2,
                       aggregation_deadline_secs=GONE_SECS / 4)
  step, counts, trace = _read(lost.cluster, jobs)
  # Before the loss, a worker late by the deadline on a loaded machine may
  # be left out of an update: not what this test is about.
  _check_counts(counts, trace, replicas=W, step=step, gone_at=gone_at[None],
                exact_before=False)


def test_two_sync_optimizers_each_let_the_lost_worker_go(lost, caplog):
  names = (None, "disc")
  jobs, gone_at = _run(lost, caplog, last_step=40, names=names)
  lines = _gone_lines(caplog)
  assert len(lines) == 2 and all("worker2 at " in l for l in lines), lines
  for name in names:
    step, counts, trace = _read(lost.cluster, jobs, name)
    _check_counts(counts, trace, replicas=W, step=step,
                  gone_at=gone_at[name])


def test_data_end_a_gone_worker_is_not_done_and_the_live_ones_end_the_job(
    lost, caplog):
  """data_end="train_all": the lost worker is gone, not done. The chief's
  input ends first (it then waits for the others), worker 1's last; the
  job ends once both live workers' inputs ended, every one of their batches
  trained, and each line counts worker 2 as gone, not done."""
  batches = [16, 24, 24]
  jobs, _ = _run(lost, caplog, batches=batches)
  step, counts, _ = _read(lost.cluster, jobs)
  assert [j.runs for j in jobs] == [16, 24, LOST_AT], [j.runs for j in jobs]
  # Every batch of the live workers trained once; the gone worker's, up to
  # its loss.
  np.testing.assert_array_equal(counts.sum(axis=0), [16, 24, LOST_AT])
  assert counts.max() == 1, counts[:step].tolist()
  messages = [r.getMessage() for r in caplog.records]
  ended = {m.split(":")[1].strip(): m for m in messages
           if "its data ended" in m}
  assert sorted(ended) == ["worker0", "worker1"], ended
  # Train runs only: each worker also reads its local step in a run of its
  # own before every push.
  assert "its data ended after 16 train steps;" in ended["worker0"], ended
  assert "its data ended after 24 train steps;" in ended["worker1"], ended
  assert "1 of 3 workers done, 1 gone; the chief keeps running updates " \
      "(each needs 1 gradients) until the other 1 worker(s) are done" in (
          ended["worker0"]), ended
  assert "2 of 3 workers done, 1 gone; every live worker is done" in (
      ended["worker1"]), ended
  # The chief's line: a worker's own "its data ended" line also says "the
  # job ends", and may be logged after it.
  last = [m for m in messages
          if "every live worker is done at global step" in m][-1]
  assert ("every live worker is done at global step %d: the job ends; 1 of "
          "3 workers gone, not done (worker2): what was left of their input "
          "was never trained" % step) in last, last


class _ReleaseAtStart(tf.compat.v1.train.SessionRunHook):
  """The returning worker's hook after ours: once ours has recorded its
  session's start (its local step is the global step X), lets the live
  workers push once at X, and returns when they wait at X + 1 (the update
  to X + 1 took their two gradients: this worker's first push is stale)
  or when ``early()`` (the chief already acted on the start)."""

  def __init__(self, gate, at, early):
    self._gate, self._at, self._early = gate, at, early
    # Set once this hook has returned: the live workers' hold at X + 1 is
    # a state that lasts only until the test opens the gate, so the test
    # opens it after this hook saw it, never before (a release between
    # the two left this hook waiting for a hold that had passed).
    self.returned = threading.Event()

  def after_create_session(self, session, coord):
    del session, coord
    try:
      self._gate.open_to(self._at + 1)
      self._gate.wait_for([0, 1], self._at + 1, also=self._early)
    finally:
      self.returned.set()


def _step_of(cluster, jobs):
  return _read(cluster, jobs)[0]


@pytest.mark.timeout(240)
def test_a_restarted_worker_left_without_a_token_is_taken_back_at_its_push(
    lost, caplog, monkeypatch):
  """docs/operations.md's old Limits window, scheduled with events: worker
  2 is gone and restarts while workers 0 and 1 hold at local step X; its
  session starts at X, then the two live workers push at X (an update that
  needs 2), so its first push is stale and it waits for a token that the
  release cut to the two others does not hold. Taken back at that hook's
  start, the next update would need its gradient while it waits for a
  token: a stall until the operation timeout. The chief waits for its push
  instead (one token given back there), and the job reaches its limit with
  every later update averaging one gradient of each worker."""
  cluster = lost.cluster
  caplog.set_level(logging.INFO, logger="sync_replicas")
  last_step = 80
  at = LOST_AT + TRANSIENT + 4
  rows = last_step + 16
  jobs = [Worker(cluster, t, replicas=W, rows=rows, last_step=last_step,
                 worker_gone_secs=GONE_SECS) for t in range(W)]
  gate = Gate(at)
  ready = threading.Event()
  threads = [support.BoundedThread(
      functools.partial(jobs[t].train, **(
          dict(lost_at=LOST_AT, leave=lost.leave) if t == 2 else
          dict(gate=gate))), ready, name="worker-%d" % t) for t in range(W)]

  def lines(words):
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("sync_replicas") and words in r.getMessage()]

  started_line = "worker2's hook started again"
  back_at_start = "worker2 is back (its hook started again)"
  threads[0].start()
  support.wait_until(lambda: ready.is_set() or not threads[0].is_alive(),
                     timeout=60, what="the chief's session")
  for t in threads[1:]:
    t.start()
  returned = None
  # Its task's address when it comes back: its real server, relayed.
  with TaskAddress(cluster.cluster_spec.as_dict()["worker"][2]) as again:
    try:
      support.wait_until(lambda: lines(" is gone"), timeout=JOB_SECS,
                         what="the chief's line declaring worker 2 gone",
                         interval=0.05)
      threads[2].finish(timeout=JOB_SECS)
      gate.wait_for([0, 1], at)
      assert _step_of(cluster, jobs) == at
      # Its task comes back: an address that answers (the probe must not
      # find it gone again), a new graph and session on its server.
      _tf_config(monkeypatch, cluster, again.address)
      back = Worker(cluster, 2, replicas=W, rows=rows, last_step=last_step,
                    worker_gone_secs=GONE_SECS)
      release = _ReleaseAtStart(gate, at, early=lambda: lines(back_at_start))
      back.hooks.append(release)
      returned = support.BoundedThread(back.train, ready, name="worker-2b")
      returned.start()
      # The chief's first look at the start (before the fix, the take-back
      # that strands it), with the live workers held at X + 1.
      support.wait_until(
          lambda: lines(started_line) or lines(back_at_start),
          timeout=JOB_SECS, what="the chief's line on worker 2's start",
          interval=0.02)
      gate.wait_for([0, 1], at + 1, also=lambda: lines(back_at_start))
      support.wait_until(
          lambda: release.returned.is_set() or not returned.is_alive(),
          timeout=JOB_SECS, what="worker 2's start hook seeing the hold",
          interval=0.02)
      gate.open_to(last_step + 1)
      # Progress, not a deadline: fails once the step stops moving.
      moved = [time.monotonic(), _step_of(cluster, jobs)]
      back_at = []

      def done():
        step = _step_of(cluster, jobs)
        if not back_at and lines("worker2 is back"):
          back_at.append(step)
        if step != moved[1]:
          moved[:] = [time.monotonic(), step]
        assert time.monotonic() - moved[0] < 10 * GONE_SECS, (
            "stalled at global step %d after worker 2's return:\n%s" % (
                step, "\n".join(lines("worker2"))))
        return step >= last_step
      support.wait_until(done, timeout=JOB_SECS, what="the step limit",
                         interval=0.1)
    except BaseException:
      # The workers' own errors (a stalled run's operation timeout) would
      # hide what failed: they are only waited for.
      gate.open_to(last_step + 1)
      for t in threads + ([returned] if returned else []):
        t.join(JOB_SECS)
      raise
    # Its address answers until every worker has ended.
    for t in threads[:2] + [returned]:
      t.finish(timeout=JOB_SECS)
  assert not lines(back_at_start), lines("worker2")
  assert len(lines(started_line)) == 1, lines("worker2")
  assert len(lines("worker2 is back (it pushed again")) == 1, lines(
      "worker2")
  step, counts, trace = _read(cluster, jobs)
  # Its first push (at X) was stale: the update to X + 1 took the two live
  # workers' gradients. Taken back at its push, every update from the next
  # but one on took one gradient of each worker.
  assert counts[at].tolist() == [1, 1, 0], counts[:step].tolist()
  assert back_at and step >= back_at[0] + 5, ("trained too far before the take-back",
                                  back_at, step)
  after = counts[back_at[0] + 2:step]
  np.testing.assert_array_equal(after, np.ones_like(after), err_msg=str(
      counts[:step].tolist()))
  np.testing.assert_allclose(trace[back_at[0] + 2:step], np.ones_like(after),
                             rtol=1e-6)

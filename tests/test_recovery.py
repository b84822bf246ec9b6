"""Crash recovery with real processes: SIGKILL a task, restart it, finish.

ps, chief and workers are separate OS processes on 127.0.0.1
(``crash_task.py``). Each case kills one task mid-training with SIGKILL,
restarts it the way a cluster manager would, runs to ``last_step`` and then
checks, from the ps, that every update averaged exactly R gradients fresh
for its step (``trace`` rows) and that every process exited cleanly.
``SYNC_REPLICAS_RECOVERY_REPEATS`` runs each case more times (for the
figures in the closing notes); CI runs each once.
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import cluster as cluster_lib
from sync_replicas.cli import _hosts

TASK = pathlib.Path(__file__).with_name("crash_task.py")
ROOT = TASK.parents[1]
REPEATS = int(os.environ.get("SYNC_REPLICAS_RECOVERY_REPEATS", "1"))
#: Every task's operation timeout.
OP_TIMEOUT_MS = 90_000
#: The longest the test waits for a restarted task while it holds the others
#: (Job.hold). A held worker may sit in its run that whole time, waiting for
#: a token that needs a held worker's gradient, so it must stay well under
#: the op timeout, which would end that run with DeadlineExceededError.
HELD_WAIT_SECS = 60
assert HELD_WAIT_SECS * 1000 < OP_TIMEOUT_MS * 0.75


class Job:
  """A cluster of task processes, and a reader session on the ps."""

  def __init__(self, tmp_path, *, workers, replicas, last_step, delay=0.03,
               ps=1, shards=None, hosts=None, count_pushes=0):
    # With ``hosts`` (emulated hosts, sync_replicas/cli/_hosts.py, one per
    # task: the ps tasks first), every task listens on 2222 of its own host.
    self._hosts = hosts
    if hosts is None:
      ports = cluster_lib.free_ports(workers + ps)
      addresses = ["127.0.0.1:%d" % p for p in ports]
    else:
      addresses = ["%s:%d" % (a, _hosts.PORT) for a in hosts.addresses]
    self.cluster = {"ps": addresses[:ps],
                    "worker": addresses[ps:ps + workers]}
    self.tmp = tmp_path
    self.base = {"cluster": self.cluster, "replicas": replicas,
                 "last_step": last_step, "delay": delay,
                 "checkpoint_dir": str(tmp_path / "ckpt"),
                 "hold_file": str(tmp_path / "hold"),
                 "op_timeout_ms": OP_TIMEOUT_MS, "shards": shards}
    if count_pushes:
      # crash_task's ``pushes``, kept apart for this many generations.
      self.base["count_pushes"] = count_pushes
    self.procs = {}
    self._reserved = {}
    self.rows = last_step + 64
    self.workers = workers
    self._reader = None

  def out(self, job, task):
    return self.tmp / ("%s%d.jsonl" % (job, task))

  def records(self, job, task):
    """The task's JSON lines (crash_task's events, with their fields)."""
    path = self.out(job, task)
    if not path.exists():
      return []
    records = []
    for line in path.read_text().splitlines():
      try:
        records.append(json.loads(line))
      except ValueError:  # A line still being written.
        break
    return records

  def events(self, job, task):
    return [r["event"] for r in self.records(job, task)]

  def start(self, job, task):
    spec = dict(self.base, job=job, task=task, out=str(self.out(job, task)))
    log = open(self.tmp / ("%s%d.log" % (job, task)), "ab")
    # tools/knockout's patched copy of the package before the checkout.
    copy = [p for p in [os.environ.get("SYNC_REPLICAS_KNOCKOUT_COPY")] if p]
    env = dict(os.environ, PYTHONPATH=support.pythonpath(*copy, ROOT),
               TF_CPP_MIN_LOG_LEVEL="2")
    argv = [sys.executable, str(TASK), json.dumps(spec)]
    if self._hosts is not None:
      argv = self._hosts.command(
          task + (0 if job == "ps" else len(self.cluster["ps"])), argv)
    # Forked from the fork server (support.start_task); with hosts, the
    # namespace wrapper's command starts fresh.
    self.procs[(job, task)] = support.start_task(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True)

  def hold(self):
    """Every worker pauses before its next step, until ``release``."""
    pathlib.Path(self.base["hold_file"]).touch()

  def release(self):
    pathlib.Path(self.base["hold_file"]).unlink()

  def hold_at_end(self, task):
    """Worker ``task`` pauses at its session's end, before its sync hook
    records a data end on the ps, until ``release_end`` (crash_task's
    ``_HoldAtEnd``; it says ``ending`` once there). Before ``start``."""
    self.base["end_hold_file"] = str(self.tmp / "end_hold_worker%d")
    pathlib.Path(self.base["end_hold_file"] % task).touch()

  def release_end(self, task):
    pathlib.Path(self.base["end_hold_file"] % task).unlink()

  def kill(self, job, task):
    support.kill_group(self.procs[(job, task)])
    if self._hosts is not None:
      return  # Nothing else can take the port on the task's own host.
    # Until the restarted task's server has bound the port again, hold it:
    # free_ports (in any process: tests run in parallel) must not hand it
    # out meanwhile. A plain bind fails next to this socket; the restarted
    # server's gRPC bind, with SO_REUSEPORT like this one, does not.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    host, port = self.cluster[job][task].rsplit(":", 1)
    sock.bind((host, int(port)))
    self._reserved[(job, task)] = sock

  def wait_ready(self, job, task, count=1, timeout=90):
    support.wait_until(
        lambda: self.events(job, task).count("ready") >= count,
        timeout=timeout, what="%s%d session #%d" % (job, task, count),
        interval=0.1)
    self._unreserve(job, task)

  def _unreserve(self, job, task):
    sock = self._reserved.pop((job, task), None)
    if sock is not None:
      sock.close()

  def _session(self):
    if self._reader is None:
      graph = tf.Graph()
      # The tasks' device setter, in their creation order: with more than
      # one ps, trace lives on ps 1.
      with graph.as_default(), tf.compat.v1.device(
          tf.compat.v1.train.replica_device_setter(
              cluster=tf.train.ClusterSpec(self.cluster))):
        gs = tf.compat.v1.train.get_or_create_global_step()
        trace = tf.compat.v1.get_variable("trace", [self.rows, self.workers])
        generations = self.base.get("count_pushes") or 1
        tf.compat.v1.get_variable("w", [4])  # Placed as the tasks' is.
        pushes = tf.compat.v1.get_variable(
            "pushes", [generations * self.rows, self.workers])
      with graph.as_default(), tf.compat.v1.device("/job:ps/task:0"):
        tokens = tf.queue.FIFOQueue(-1, tf.int64, shapes=(),
                                    shared_name="sync_token_q").size()
      config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=10_000,
                                        device_filters=["/job:ps"])
      sess = tf.compat.v1.Session("grpc://" + self.cluster["ps"][0],
                                  graph=graph, config=config)
      self._reader = (sess, {"global_step": gs, "trace": trace,
                             "tokens": tokens, "pushes": pushes})
    return self._reader

  def read(self, what):
    """Reads ``global_step``, ``trace``, ``tokens`` or (with
    ``count_pushes``) ``pushes`` (by generation, step and task); None while
    down."""
    sess, tensors = self._session()
    try:
      value = sess.run(tensors[what])
      if what == "pushes":
        return value.reshape([-1, self.rows, self.workers])
      return value
    except (tf.errors.FailedPreconditionError,
            tf.errors.DeadlineExceededError):
      return None
    except (tf.errors.UnavailableError, tf.errors.AbortedError):
      # The ps (our master) went away or restarted: reconnect next time.
      self._close_reader()
      return None

  def _close_reader(self):
    if self._reader is not None:
      try:
        self._reader[0].close()
      except tf.errors.OpError:
        pass  # A restarted master no longer knows the session.
      self._reader = None

  def read_when_up(self, what, timeout=60):
    """Like ``read``, waiting (bounded) through a reconnect."""
    found = []
    support.wait_until(lambda: found.append(self.read(what)) or
                       found[-1] is not None, timeout=timeout,
                       what="reading %s from the ps" % what, interval=0.2)
    return found[-1]

  def wait_step(self, at_least, timeout=120):
    support.wait_until(lambda: (self.read("global_step") or 0) >= at_least,
                       timeout=timeout, what="global_step >= %d" % at_least,
                       interval=0.1)
    return int(self.read("global_step"))

  def finish_workers(self, timeout=150, lost=()):
    """Waits for every worker but those in ``lost`` (killed for good) to
    exit 0 after its ``done`` event."""
    deadline = time.monotonic() + timeout
    for (job, task), proc in sorted(self.procs.items()):
      if job != "worker" or task in lost:
        continue
      proc.wait(timeout=max(deadline - time.monotonic(), 1))
      assert proc.returncode == 0, "worker%d exited %d:\n%s" % (
          task, proc.returncode, self.log_tail("worker", task))
      assert self.events("worker", task)[-1] == "done"

  def log(self, job, task):
    return (self.tmp / ("%s%d.log" % (job, task))).read_text(errors="replace")

  def log_tail(self, job, task):
    return (self.tmp / ("%s%d.log" % (job, task))).read_text()[-4000:]

  def close(self):
    # The reader first, while its ps still runs: closing a session whose
    # master is gone spends 10 s on gRPC retries (in every test's teardown).
    # The processes in the finally: nothing that fails may leave one running.
    try:
      self._close_reader()
    finally:
      for proc in self.procs.values():
        support.kill_group(proc)
      for key in list(self._reserved):
        self._unreserve(*key)


def _start(job):
  for task in range(len(job.cluster["ps"])):
    job.start("ps", task)
  job.start("worker", 0)
  job.wait_ready("worker", 0)
  for task in range(1, job.workers):
    job.start("worker", task)


def _assert_only_fresh_updates(job, replicas):
  step = int(job.read_when_up("global_step"))
  rows = job.read_when_up("trace").sum(axis=1)
  np.testing.assert_array_equal(
      rows[:step], np.full(step, replicas),
      err_msg="an update that was not R fresh gradients")
  np.testing.assert_array_equal(rows[step:], 0)
  return step


@pytest.fixture
def job_factory(tmp_path):
  jobs = []

  def make(**kwargs):
    job = Job(tmp_path / str(len(jobs)), **kwargs)
    (tmp_path / str(len(jobs))).mkdir()
    jobs.append(job)
    return job

  yield make
  for job in jobs:
    job.close()


@pytest.mark.timeout(300 * REPEATS)
@pytest.mark.parametrize("repeat", range(REPEATS))
def test_killed_backup_worker_rejoins_and_contributes(job_factory, repeat):
  del repeat
  # Enough steps after the restart for the restarted worker to be among
  # the first R of some update: it comes back some 10-25 steps in (its
  # first applied gradient, ten steps, the restart under the hold), and
  # each update after takes the gradients of the 2 of 3 workers whose
  # random pause (delay) ended first. 300 steps trained some 200 more
  # than that needs, which no assert reads.
  last_step = 100
  job = job_factory(workers=3, replicas=2, last_step=last_step, delay=0.05)
  # Two workers could train without worker 2: none trains before all three
  # are up, or a slow start-up would leave it nothing to contribute to.
  job.hold()
  _start(job)
  for task in range(1, 3):  # Nobody is in a run yet: no op to time out.
    job.wait_ready("worker", task)
  job.release()
  support.wait_until(lambda: job.read("trace")[:, 2].sum() > 0, timeout=90,
                     what="worker 2's first applied gradient", interval=0.2)
  killed_at = int(job.read("global_step"))
  job.kill("worker", 2)
  # Two workers suffice with one backup: training goes on without it.
  job.wait_step(killed_at + 10)
  # The others wait while worker 2 restarts: how long a restart takes (an
  # import of TensorFlow on a loaded machine) must not decide whether
  # training ends first.
  job.hold()
  job.start("worker", 2)
  # Its first life said ready once.
  job.wait_ready("worker", 2, count=2, timeout=HELD_WAIT_SECS)
  rejoined_at = int(job.read("global_step"))
  job.release()
  assert rejoined_at < last_step, "training ended before the worker came back"
  job.finish_workers()
  final = _assert_only_fresh_updates(job, replicas=2)
  assert final >= last_step
  contributed = job.read("trace")[rejoined_at:, 2].sum()
  assert contributed > 0, "the restarted worker never contributed"


@pytest.mark.timeout(400 * REPEATS)
@pytest.mark.parametrize("repeat", range(REPEATS))
def test_killed_chief_resumes_from_checkpoint_without_stale_gradients(
    job_factory, repeat):
  del repeat
  job = job_factory(workers=2, replicas=2, last_step=60)
  _start(job)
  step = 12
  for restart in range(1, 4):
    killed_at = job.wait_step(step)
    job.kill("worker", 0)
    job.start("worker", 0)
    job.wait_ready("worker", 0, count=restart + 1)
    # Exactly the new initial tokens (R), plus at most one update's worth
    # already released: restarts never pile tokens up.
    assert job.read("tokens") <= 2 + 2
    step = killed_at + 8
  job.finish_workers()
  assert _assert_only_fresh_updates(job, replicas=2) >= 60


@pytest.mark.timeout(500 * REPEATS)
@pytest.mark.parametrize("repeat", range(REPEATS))
def test_each_killed_ps_recovers_through_monitored_session(job_factory,
                                                          repeat):
  """Each of two ps tasks killed and restarted in turn, in one cluster.

  First ps 1, which holds trace's accumulator but not the token queue (ps 0
  does; found by tools/soak, issue 20). Its death makes the chief's
  MonitoredSession recreate its session, and the chief's close on that stop
  used to close the token queue on the surviving ps 0: every worker then
  ended as if training were done, and the recovered chief failed enqueueing
  its tokens into the closed queue. Then ps 0, with the global step and the
  token queue: the chief restores the last checkpoint onto the new ps, and
  everyone's MonitoredSession recreates its session and goes on to the last
  step. (Two tests with a cluster each before, one ps killed in each: a
  cluster's three TensorFlow processes and its training saved.)
  """
  del repeat
  job = job_factory(workers=2, replicas=2, last_step=70, ps=2)
  _start(job)
  job.wait_step(15)
  job.kill("ps", 1)
  job.start("ps", 1)
  # Training goes on after ps 1's restart (from the chief's restore of the
  # last checkpoint): with the token queue closed, every worker ended here.
  job.wait_step(35, timeout=240)
  for task in (0, 1):
    assert "done" not in job.events("worker", task), (
        "worker %d ended after ps 1's restart" % task)
  restores = job.log("worker", 0).count("Restoring parameters from")
  assert restores >= 1, job.log_tail("worker", 0)
  job.kill("ps", 0)
  job.start("ps", 0)
  job.finish_workers(timeout=240)
  # A restore of its own, onto the new ps 0.
  assert job.log("worker", 0).count("Restoring parameters from") > restores, (
      job.log_tail("worker", 0))
  assert _assert_only_fresh_updates(job, replicas=2) >= 70


def _trained(job, task):
  """The batches worker ``task`` trained, from its ``done`` event."""
  lines = job.out("worker", task).read_text().splitlines()
  return [json.loads(l) for l in lines][-1]["runs"]


def _finish_showing_the_chief(job, *, timeout, lines, lost=()):
  """``job.finish_workers``; on failure the chief's own last ``lines``
  sync_replicas lines (its restore, its stall lines) say who waited."""
  try:
    job.finish_workers(timeout=timeout, lost=lost)
  except (AssertionError, subprocess.TimeoutExpired) as e:
    said = [l for l in job.log("worker", 0).splitlines()
            if "sync_replicas:" in l]
    raise AssertionError("%s\nthe chief's sync_replicas lines:\n%s"
                         % (e, "\n".join(said[-lines:]))) from e


@pytest.mark.timeout(400)
def test_killed_ps_keeps_the_record_of_a_worker_whose_data_ended(
    job_factory):
  """data_end="train_all" (issue 36): done-ness survives a ps restart.

  Worker 1's one-pass shard ends first; it records on the ps that it is
  done and exits. Then the ps is killed and started again on its port: its
  record of the workers done is gone, and worker 1 cannot say it again. The
  chief, which remembers it, puts it back on its recovered session, so the
  updates need two gradients again and the other two workers train on to
  the end of their shards; without that every update would wait for three
  gradients, and the two would hang until their operation timeout.

  What the workers trained is counted by themselves (each counts a batch
  once its train run returned; a run a restart failed trains the same batch
  again), not from the updates on the ps: the restarted ps got the model
  back from the chief's last checkpoint, and the updates after it are lost.
  """
  # Data left for after the restart at any load: 60 batches each. At a
  # load average of 30 workers 0 and 2 reached the ps kill at batch 17-18;
  # on a quiet machine they train faster than the test's polls, and 30
  # left none (tried: the job ended before the kill).
  shards = [60, 8, 60]
  job = job_factory(workers=3, replicas=3, last_step=sum(shards),
                    delay=0.05, shards=shards)
  _start(job)
  support.wait_until(lambda: "done" in job.events("worker", 1), timeout=120,
                     what="worker 1's data end", interval=0.1)
  assert _trained(job, 1) == shards[1]
  # Two updates after it: the chief's loop, which polls once a worker is
  # done, read the record and remembers worker 1.
  job.wait_step(int(job.read_when_up("global_step")) + 2)
  # The others pause between steps, so that they still have data left when
  # the ps comes back, however long its restart takes.
  job.hold()
  for task in (0, 2):
    assert "done" not in job.events("worker", task), "ended before the kill"
  job.kill("ps", 0)
  job.start("ps", 0)
  job.release()
  _finish_showing_the_chief(job, timeout=240, lines=30)
  chief_log = job.log("worker", 0)
  assert "Restoring parameters from" in chief_log
  assert "the chief saw done (its ps task restarted?): put back worker1" in (
      chief_log), chief_log[-4000:]
  assert [_trained(job, t) for t in range(3)] == shards


#: Worker 1's lines when its data-end record meets a ps task that does not
#: answer (sync_replicas/_announce.py), then once it recorded it.
RECORD_RETRIED = "could not record its data end on the ps"
RECORD_LANDED = "recorded its data end on the ps after"


@pytest.mark.timeout(300)
def test_a_worker_whose_data_ends_while_the_ps_is_down_records_it_after(
    job_factory):
  """data_end="train_all": a data end that meets the done record's ps task
  down is recorded once that task is back (issue 46).

  Worker 1's one-pass shard (4 batches) ends first, and the test holds it
  in its session's end, before its sync hook records the end on the ps
  (crash_task's ``end_hold_file``). The others cannot train past it: each
  update still needs its gradient. Then the ps is killed and worker 1 let
  go: its record meets a task that does not answer, and it says it tries
  again. Then the ps starts again on its port. Worker 1's session can never
  run there again (the new task does not know it: "Session handle is not
  found"), so worker 1 records through a new session; the chief learns it
  from the record, the updates need two gradients, and the others train
  their shards to the end, well before the operation timeout. Before,
  worker 1 logged "the job is probably over" and exited 0: the restarted
  ps never learnt it was done, the chief had not seen it done, and every
  update waited for its gradient until that timeout (SyncTimeoutError
  naming it "no step yet").
  """
  # The others' shards only need data left after the restart: they wait
  # for worker 1's gradient in their train runs from its end on, each a
  # batch or two past its 4.
  shards = [16, 4, 16]
  job = job_factory(workers=3, replicas=3, last_step=sum(shards),
                    delay=0.05, shards=shards)
  job.hold_at_end(1)
  _start(job)
  support.wait_until(lambda: "ending" in job.events("worker", 1),
                     timeout=120, interval=0.1,
                     what="worker 1 held at its data end, not yet recorded")
  assert job.records("worker", 1)[-1]["runs"] == shards[1]
  job.kill("ps", 0)
  job.release_end(1)
  # Worker 1's line that it tries again, or its exit without it (the
  # failure this test is for).
  support.wait_until(
      lambda: RECORD_RETRIED in job.log("worker", 1) or (
          "done" in job.events("worker", 1)),
      timeout=60, interval=0.1, what="worker 1's record meeting the ps down")
  assert RECORD_RETRIED in job.log("worker", 1), job.log_tail("worker", 1)
  assert "done" not in job.events("worker", 1), job.log_tail("worker", 1)
  restarted = time.monotonic()
  job.start("ps", 0)
  _finish_showing_the_chief(job, timeout=OP_TIMEOUT_MS / 1000, lines=30)
  took = time.monotonic() - restarted
  # The failure it replaces ends at the operation timeout, 90 s.
  assert took < OP_TIMEOUT_MS / 1000 / 2, took
  assert RECORD_LANDED in job.log("worker", 1), job.log_tail("worker", 1)
  chief_log = job.log("worker", 0)
  # One line per read of the record that found workers newly done: worker 2
  # may share worker 1's.
  learnt = re.findall(r"the chief learnt from the record on the ps that "
                      r"(.*) (?:is|are) done", chief_log)
  assert any("worker1" in names.split(", ") for names in learnt), (
      chief_log[-4000:])
  assert [_trained(job, t) for t in range(3)] == shards


@pytest.mark.timeout(120)
def test_a_data_end_that_meets_the_ps_gone_for_good_gives_up_at_the_timeout(
    caplog):
  """The bound of the tries above: a worker whose data end meets the done
  record's ps task gone for good tries for its session's
  operation_timeout_in_ms (3 s here), says it gave up, and returns, so that
  its process exits; it records nothing (a try left waiting for that
  address records nothing if it ever answers)."""
  ports = cluster_lib.free_ports(2)
  cluster = {"ps": ["127.0.0.1:%d" % ports[0]],
             "worker": ["127.0.0.1:%d" % ports[1]]}
  ps = support.start_crash_task_ps(
      cluster, dict(os.environ, PYTHONPATH=support.pythonpath(ROOT)))
  try:
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster),
                                  job_name="worker", task_index=0)
    with tf.Graph().as_default() as graph, tf.compat.v1.device(
        tf.compat.v1.train.replica_device_setter(
            cluster=tf.train.ClusterSpec(cluster),
            worker_device="/job:worker/task:0")):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1),
          replicas_to_aggregate=1, total_num_replicas=1)
      opt.minimize(tf.square(w), global_step=global_step)
    config = tf.compat.v1.ConfigProto(
        operation_timeout_in_ms=3_000,
        device_filters=["/job:ps", "/job:worker/task:0"])
    with tf.compat.v1.Session(server.target, graph=graph,
                              config=config) as sess:
      # The session's first run waits for the forked ps to serve (bounded
      # by the test's timeout).
      sess.run(global_step.initializer)
      support.kill_group(ps)
      start = time.monotonic()
      with caplog.at_level("INFO", logger="sync_replicas"):
        opt.announce_data_end(sess, is_chief=False, batches=3)
      took = time.monotonic() - start
  finally:
    support.kill_group(ps)
  said = caplog.text
  assert RECORD_RETRIED in said and "for up to 3 s" in said, said
  assert re.search(r"worker0 gave up recording its data end on the ps after "
                   r"3 s and \d+ tries", said), said
  assert "its data ended" not in said, said
  # Its tries start 2 and 4 s apart: none may hold it past the bound.
  assert 3.0 <= took < 6.0, took


@pytest.mark.timeout(400)
def test_killed_ps_keeps_the_mark_of_a_worker_gone_for_good(job_factory):
  """worker_gone_secs: gone-ness survives a ps restart as done-ness does.

  Worker 1 is SIGKILLed for good and the chief declares it gone (no push for
  T seconds while the update waits, and its address refuses connections).
  Then the ps is killed and started again on its port: its record of the
  workers out of the updates is gone, and nobody will say again that worker
  1 is. The chief, which remembers the mark, puts it back on its recovered
  session, so the updates keep needing two gradients and workers 0 and 2
  train their shards to the end; without that every update would wait for
  worker 1's gradient again, until the operation timeout.
  """
  # Data left for after the restart at any load. Until worker 1 is
  # declared gone (3 s without its push, and the look after), the updates
  # take workers 0's and 2's extra gradients, so those two train at their
  # own pace: at a mean pause of 0.05 s a batch, a quiet machine's workers
  # ended all of 60 around the ps kill (CI, 2026-11-29: worker 2's data
  # ended as the ps restarted, its done record was lost with it, and the
  # chief waited for it until the operation timeout). A mean pause of 0.2 s
  # keeps them to about 5 batches a second, some 25 of 60 by the kill.
  shards = [60, 60, 60]
  job = job_factory(workers=3, replicas=3, last_step=sum(shards),
                    delay=0.2, shards=shards)
  job.base["opt_kwargs"] = {"worker_gone_secs": 3.0}
  _start(job)
  job.wait_step(5)
  job.kill("worker", 1)  # Its port stays bound, not listening: refused.
  support.wait_until(lambda: "worker1 at " in job.log("worker", 0) and (
      "is gone (worker_gone_secs=3" in job.log("worker", 0)), timeout=120,
                     what="the chief's line declaring worker 1 gone",
                     interval=0.2)
  # Two updates after it, with two gradients each.
  job.wait_step(int(job.read_when_up("global_step")) + 2)
  job.hold()
  job.kill("ps", 0)
  job.start("ps", 0)
  job.release()
  _finish_showing_the_chief(job, timeout=240, lines=30, lost=(1,))
  chief_log = job.log("worker", 0)
  assert "Restoring parameters from" in chief_log
  assert "the chief saw done (its ps task restarted?): put back worker1" in (
      chief_log), chief_log[-4000:]
  # The last of the two to end says the job ends, and counts worker 1 gone.
  ends = job.log("worker", 0) + job.log("worker", 2)
  assert "2 of 3 workers done, 1 gone; every live worker is done" in ends, (
      chief_log[-4000:])
  assert [_trained(job, t) for t in (0, 2)] == [shards[0], shards[2]]


#: The ps the 16-worker test kills: ps 1 holds ``trace`` and its
#: accumulator, ps 0 the global step, ``w`` and the token queue.
KILLED_PS = 1
#: The worker it kills: the longest shard after the chief's (20 batches), so
#: that it still trains when killed.
KILLED_WORKER = 10


def _checkpointed_step(job):
  """The step of the chief's newest checkpoint, or -1."""
  path = tf.train.latest_checkpoint(job.base["checkpoint_dir"])
  return -1 if path is None else int(path.rsplit("-", 1)[1])


def _hold_chief(job):
  """Holds every worker and waits until the chief is paused between steps:
  no update can come then (each needs the chief's gradient), whatever the
  other workers' runs in flight wait for."""
  seen = len(job.events("worker", 0))
  job.hold()
  support.wait_until(lambda: "held" in job.events("worker", 0)[seen:],
                     timeout=120, what="the chief held", interval=0.2)


def _gradients_per_cell(trace, steps, replicas):
  """How many gradients of each worker each of the first ``steps`` updates
  applied.

  An update adds R * (the worker's gradients in it) / (all of its
  gradients) to a worker's cell of its row: a row gives the counts up to a
  common factor, and the smallest whole counts are taken. (One worker's
  two gradients alone in an update read as one: that can only count a push
  lost that was applied, never the reverse.)
  """
  counts = np.zeros(trace.shape, int)
  for u in range(steps):
    for n in range(1, 4 * replicas + 1):
      cells = trace[u] * n / replicas
      whole = np.rint(cells)
      if np.allclose(cells, whole, atol=1e-3) and whole.sum() == n:
        counts[u] = whole
        break
    else:
      raise AssertionError("update %d is no whole number of gradients: %s"
                           % (u, trace[u]))
  return counts


def _generation(local_step):
  return local_step >> 32


def _plain(local_step):
  return local_step & 0xFFFFFFFF


def _lost_pushes(records, applied, *, killed_at, ps_step):
  """The pushes of runs that returned and are in no update, as ``(at steps
  before the ps kill's, ps_step; after it with a local step of an older
  generation than the chief's last start; of that generation)``, and the
  cells where an update applied a gradient that no returned run accounts
  for (a batch trained twice).

  Each worker's returned runs (crash_task's ``run`` events, its killed
  first life's included) say which step each pushed at. The killed worker's
  run in flight at its kill (``killed_at``, a (time, task) pair) may be in
  an update although it never returned: one gradient more is allowed at
  the step it pushed at.
  """
  last = _generation(_chief_start(records, after=0))
  pushed = np.zeros_like(applied)
  old = np.zeros_like(applied)
  for task, task_records in enumerate(records):
    for r in task_records:
      if r["event"] == "run":
        pushed[_plain(r["pushed"]), task] += 1
        old[_plain(r["pushed"]), task] += _generation(r["pushed"]) < last
  when, task = killed_at
  first_life = [r for r in records[task]
                if r["t"] < when and r["event"] in ("session", "run")]
  in_flight = _plain(first_life[-1].get("next", first_life[-1].get("label")))
  pushed[in_flight, task] += 1
  twice = [(int(s), int(t)) for s, t in np.argwhere(applied > pushed)]
  pushed[in_flight, task] -= 1
  lost = np.maximum(pushed - applied, 0)
  lost_old = int(np.minimum(lost, old)[ps_step:].sum())
  lost_new = int(lost[ps_step:].sum()) - lost_old
  return int(lost[:ps_step].sum()), lost_old, lost_new, twice


def _chief_start(records, *, after):
  """The local step of the chief's last session started after ``after``
  (a time): the global step and generation of its init."""
  starts = [r["label"] for r in records[0]
            if r["event"] == "session" and r["t"] > after]
  assert starts, "the chief started no session after %s" % after
  return starts[-1]


def _rights_beyond_the_updates(records, applied, *, ps_killed_at, replicas):
  """Rights to push that no update takes, made from the ps kill on, as
  ``(before the chief's last start, from it)``: at most one lost push each.

  Every push needs a right: a token, or a session's first push (its local
  step starts at the global step). Each release gives as many tokens as the
  next update takes; what the faults add beyond that:

  * of the generations before the chief's last start, whose pushes all end
    dropped: the right each worker not done held at the ps kill (a token,
    or a push in flight into the killed ps, whose run returns with a token
    of the new generation), the first push of each session that read the
    generation before the chief's init moved it (a worker's session made
    again after the chief's restore and before its init), and R tokens and
    one right per worker for each chief start a later one replaced (the
    killed worker's token never taken, if no one used it before the ps
    kill, is one a worker held then, or the chief's init drained it);
  * of the last generation: the chief's R initial tokens and the first
    pushes of the sessions started in it, less what the first update of it
    applied, plus one per worker done after the ps kill without a run
    returned after it (its end cut a release by a token it never took).
  """
  last = _chief_start(records, after=ps_killed_at)
  before = _chief_start([[r for r in records[0] if r["t"] < ps_killed_at]],
                        after=0)
  sessions = [r["label"] for task_records in records for r in task_records
              if r["event"] == "session" and r["t"] > ps_killed_at]
  late_sessions = sum(_generation(s) == _generation(last) for s in sessions)
  replaced = _generation(last) - _generation(before) - 1
  live, late_done = 0, 0
  for task_records in records:
    done = [r["t"] for r in task_records if r["event"] == "done"]
    live += not done or done[0] > ps_killed_at
    late_done += bool(done) and done[0] > ps_killed_at and not any(
        r["event"] == "run" and r["t"] > ps_killed_at for r in task_records)
  old = (live + len(sessions) - late_sessions
         + (replicas + len(records)) * replaced)
  new = (replicas + late_sessions - int(applied[_plain(last)].sum())
         + late_done)
  return old, new


@pytest.mark.timeout(600)
@pytest.mark.scale(reason=(
    "16 workers and 2 ps on 18 hosts (about 117 CPU-seconds): a killed "
    "worker and a killed ps recovered at a small scale are this file's "
    "test_each_killed_ps_recovers_through_monitored_session and "
    "test_killed_ps_keeps_the_record_of_a_worker_whose_data_ended, every "
    "batch trained once at data end test_data_end's"))
@pytest.mark.skipif(not support.is_machine_root(), reason=(
    "emulated hosts need the machine's root here (network namespaces and a "
    "bridge in this machine's namespace, as tools/soak --faults cut)"))
@pytest.mark.skipif(
    tuple(int(x) for x in tf.__version__.split(".")[:2]) < (2, 16),
    reason="16 TensorFlow processes cost about 90 CPU-seconds: CI runs this "
    "with the newest TensorFlow only (issue 43), the protocol's code is the "
    "same on 2.15")
def test_16_workers_and_2_ps_on_hosts_train_every_batch_through_kills(
    tmp_path):
  """W = 16, P = 2, each task on an emulated host of its own,
  data_end="train_all" with shards of seeded random sizes (two empty, the
  chief's the longest).

  While the others hold, a worker is SIGKILLed and started again on its
  host (it trains its shard again from the start), and later a ps, once the
  chief's checkpoint (one per step) holds the last update: the restarted ps
  gets the model back with nothing lost. Every worker exits 0 after training
  its whole shard; every update averaged R fresh gradients (``trace``: each
  update's row sums to R, and says how many gradients of each worker it
  averaged); no update applied a gradient that no returned run accounts
  for (a batch trained twice); every batch is in an update but for the
  stale pushes that the rights to push the faults made beyond what the
  updates take explain, at most one per right (``_rights_beyond_the_updates``).

  Without the push gate (``_routes._push_gate``) a worker's last run, whose
  input ended, still pushed ``trace``'s gradient (it does not depend on the
  input) into its accumulator alone on ps 1, whose take then got a step
  ahead of ``w``'s: every later push to it was stale and the job hung until
  the op timeout (6 runs in 6 on 127.0.0.1 without the kills).
  """
  shards = np.random.default_rng(43).integers(0, 21, 16)
  shards[0] = 60
  shards = [int(n) for n in shards]
  assert shards[KILLED_WORKER] == max(shards[1:])
  tag = os.getpid()
  hosts = _hosts.Hosts(18, prefix="sync-test-%d-" % tag, bridge="srt%d" % tag,
                       link_prefix="srt%dv" % tag)
  try:
    job = Job(tmp_path, workers=16, replicas=16, ps=2, last_step=sum(shards),
              delay=0.05, shards=shards, hosts=hosts)
    job.base["checkpoint_steps"] = 1
    try:
      _start(job)
      job.wait_step(2, timeout=240)
      job.hold()
      # The events' clock (crash_task's ``t``): what came before each kill.
      worker_killed_at = time.time()
      job.kill("worker", KILLED_WORKER)
      job.start("worker", KILLED_WORKER)
      job.wait_ready("worker", KILLED_WORKER, count=2, timeout=120)
      # Its new life pushes from this step on (held until the release).
      restarted_at = int(job.read_when_up("global_step"))
      job.release()
      job.wait_step(restarted_at + 2)
      _hold_chief(job)
      # The step stays, and the chief's checkpoint of it (one per step) is
      # the whole model, which the restarted ps gets back.
      step = int(job.read_when_up("global_step"))
      support.wait_until(lambda: _checkpointed_step(job) == step,
                         timeout=60, what="a checkpoint of step %d" % step,
                         interval=0.2)
      assert "done" not in job.events("worker", 0), "ended before the kill"
      ps_step, ps_killed_at = step, time.time()
      job.kill("ps", KILLED_PS)
      job.start("ps", KILLED_PS)
      job.release()
      _finish_showing_the_chief(job, timeout=300, lines=20)
      assert re.search(r"Restoring parameters from \S+/model\.ckpt-%d$"
                       % step, job.log("worker", 0), re.M), "no restore"
      assert [_trained(job, t) for t in range(16)] == shards
      step = int(job.read_when_up("global_step"))
      trace = job.read_when_up("trace")
      np.testing.assert_allclose(trace.sum(axis=1)[:step], 16, rtol=1e-5,
                                 err_msg="an update that was not R fresh "
                                 "gradients")
      np.testing.assert_array_equal(trace[step:], 0)
      assert (trace[:restarted_at, KILLED_WORKER] > 0).any(), (
          "the killed worker trained nothing before")
      # Every push of a run that returned is in an update, once, but for
      # the rights to push the faults made beyond what the updates take
      # (docs/data_end.md: "a resumed job's first steps may drop a few
      # pushes as stale"), each of which ends as one stale, dropped push
      # at most. How many rights that is is timing (which sessions read
      # the generation before the chief's init, who was in a run at the
      # kill), read from the workers' events.
      records = [job.records("worker", t) for t in range(16)]
      applied = _gradients_per_cell(trace, step, 16)
      lost_before, lost_old, lost_new, twice = _lost_pushes(
          records, applied, killed_at=(worker_killed_at, KILLED_WORKER),
          ps_step=ps_step)
      assert not twice, ("a batch trained twice: (step, task)", twice)
      rights_old, rights_new = _rights_beyond_the_updates(
          records, applied, ps_killed_at=ps_killed_at, replicas=16)
      # Before the ps kill the only right beyond the updates is the killed
      # worker's token never taken (its run in flight at the kill).
      assert (lost_before <= 1 and lost_old <= rights_old
              and lost_new <= rights_new), (
                  "lost pushes (before the ps kill, older generations, the "
                  "last one)", (lost_before, lost_old, lost_new), "rights",
                  (1, rights_old, rights_new), "gradients per update",
                  applied.sum(axis=1)[:step].tolist())
    finally:
      job.close()
  finally:
    hosts.close()

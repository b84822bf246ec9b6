"""sync_replicas.wait_for_chief_init: the non-chief's wait, through ps restarts.

Regression for issue 44's CI flake: tools/soak (seed 741393490) saw a
replica started while a ps restarted log "still waiting for the chief ...
last poll: UnavailableError" for 300 s, then exit 1, while the others
trained. The wait kept the session of a poll that failed with
UnavailableError; that session's channels to the ps back off for minutes.
"""

import os
import pathlib
import subprocess
import sys
import threading
import time
import weakref

import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import cluster as cluster_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: How soon after the restarted ps is initialized the wait must end. A new
#: session reaches the ps at once; the failed poll's close may take one op
#: timeout (5 s here). The session the wait used to keep answered
#: UnavailableError 20-40 s longer (measured, 2026-11-27).
AFTER_INIT_SECS = 15
#: How long the ps stays down once the waiter's polls fail: long enough for
#: a kept session's channels to back off well past AFTER_INIT_SECS.
DOWN_SECS = 8


@pytest.mark.timeout(400)
def test_wait_ends_soon_after_a_ps_that_was_down_is_back(tmp_path,
                                                         monkeypatch):
  ports = cluster_lib.free_ports(2)
  cluster = {"ps": ["127.0.0.1:%d" % ports[0]],
             "worker": ["127.0.0.1:%d" % ports[1]]}
  env = dict(os.environ, PYTHONPATH=support.pythonpath(ROOT))

  def start_ps():
    return support.start_crash_task_ps(cluster, env)

  ps = start_ps()
  try:
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster),
                                  job_name="worker", task_index=0)
    with tf.Graph().as_default() as graph:
      with tf.compat.v1.device("/job:ps/task:0"):
        tf.compat.v1.get_variable("v", [], initializer=tf.ones_initializer())
      uninitialized = tf.compat.v1.report_uninitialized_variables()
      # The filters README's program and the examples use: the session then
      # has channels of its own to the ps.
      config = tf.compat.v1.ConfigProto(
          operation_timeout_in_ms=5_000,
          device_filters=["/job:ps", "/job:worker/task:0"])
    polls = _Polls(uninitialized, monkeypatch)
    waiter = support.BoundedThread(
        lambda: sync_replicas.wait_for_chief_init(
            server.target, uninitialized, config=config, graph=graph,
            timeout_secs=300.0, log_secs=0),
        name="wait_for_chief_init")
    support.wait_until(lambda: _ran(server.target, graph, uninitialized,
                                    config),
                       timeout=150, what="the ps serving", interval=0.2)
    waiter.start()
    polls.wait_for(lambda seen: "answered" in seen, what="a first answer")
    support.kill_group(ps)
    polls.wait_for(lambda seen: "UnavailableError" in seen,
                   what="a poll failing with UnavailableError")
    # The chief's part, from a process of its own as in a job: a session
    # of this process would reconnect the waiter's channels with its own
    # (gRPC shares connections to one address within a process). It polls
    # the ps with new sessions, so it initializes as soon as the ps is back.
    chief = subprocess.Popen(
        [sys.executable, "-c", _INIT_FROM_ANOTHER_PROCESS, cluster["ps"][0]],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
      said = []
      for line in chief.stdout:  # Ends at "polling", or its exit.
        said.append(line)
        if line.strip() == "polling":
          break
      assert said and said[-1].strip() == "polling", "".join(said)[-2000:]
      # Event-driven bounds above; this one is the outage itself.
      time.sleep(DOWN_SECS)
      ps = start_ps()
      out, _ = chief.communicate(timeout=200)
    finally:
      support.kill_group(chief)
    assert chief.returncode == 0, out[-2000:]
    initialized = time.monotonic()
    waiter.finish(timeout=AFTER_INIT_SECS + 60)
    took = time.monotonic() - initialized
    assert took < AFTER_INIT_SECS, (
        "the wait ended %.0f s after the restarted ps was initialized "
        "(polls: %s)" % (took, polls.seen[-12:]))
    # The cause, seen directly: whether a kept session's next connection
    # attempt falls soon after the restart is up to gRPC's backoff (with
    # jitter), so the bound above alone could pass by luck.
    assert not polls.reused_after_failure, (
        "polls ran again in a session whose earlier poll failed: %s"
        % polls.reused_after_failure[:5])
  finally:
    support.kill_group(ps)


def test_wait_gives_up_saying_what_it_last_saw(caplog):
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  with tf.Graph().as_default() as graph:
    with tf.compat.v1.device("/job:ps/task:0"):
      tf.compat.v1.get_variable("never", [], initializer=tf.ones_initializer())
    uninitialized = tf.compat.v1.report_uninitialized_variables()
  with caplog.at_level("INFO", logger="sync_replicas.ready"), pytest.raises(
      TimeoutError) as gave_up:
    sync_replicas.wait_for_chief_init(
        cluster.worker_targets[0], uninitialized, graph=graph,
        config=support.session_config(), timeout_secs=1.5, log_secs=0.5)
  assert ("did not initialize the model within 2 s (last poll: 1 "
          "variable(s) not initialized)") in str(gave_up.value)
  assert any("still waiting for the chief" in r.getMessage()
             for r in caplog.records), caplog.text


@pytest.mark.parametrize("name,value", [
    ("timeout_secs", -1), ("poll_secs", "0.5"), ("log_secs", True)],
    ids=["negative", "string", "bool"])
def test_bad_bounds_are_refused_before_any_session(name, value):
  with pytest.raises(ValueError, match="%s must be a number >= 0" % name):
    sync_replicas.wait_for_chief_init("grpc://127.0.0.1:1", None,
                                      **{name: value})


#: Initializes ``v`` on the ps at argv[1] once it serves (within 150 s).
_INIT_FROM_ANOTHER_PROCESS = """
import sys, time
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
v = tf.compat.v1.get_variable("v", [], initializer=tf.ones_initializer())
config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=5000)
deadline = time.monotonic() + 150
print("polling", flush=True)
while True:
  try:
    with tf.compat.v1.Session("grpc://" + sys.argv[1], config=config) as s:
      s.run(v.initializer)
    break
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError):
    if time.monotonic() > deadline:
      raise
    time.sleep(0.2)
"""


class _Polls:
  """What each of the waiter thread's polls of ``fetch`` ended with."""

  def __init__(self, fetch, monkeypatch):
    self.seen = []
    #: (error, what the later poll in the same session ended with).
    self.reused_after_failure = []
    # session -> the error its poll ended with (weak: an id would be
    # reused by the next session once the closed one is collected).
    failed = weakref.WeakKeyDictionary()
    self._changed = threading.Condition()
    run = tf.compat.v1.Session.run

    def noting_run(session, fetches, *args, **kwargs):
      if (fetches is not fetch
          or threading.current_thread().name != "wait_for_chief_init"):
        return run(session, fetches, *args, **kwargs)
      earlier = failed.get(session)
      try:
        result = run(session, fetches, *args, **kwargs)
      except tf.errors.OpError as e:
        failed[session] = type(e).__name__
        self._note(type(e).__name__, earlier)
        raise
      self._note("answered", earlier)
      return result

    monkeypatch.setattr(tf.compat.v1.Session, "run", noting_run)

  def _note(self, what, earlier):
    with self._changed:
      self.seen.append(what)
      if earlier is not None:
        self.reused_after_failure.append((earlier, what))
      self._changed.notify_all()

  def wait_for(self, condition, *, what, timeout=120):
    with self._changed:
      if not self._changed.wait_for(lambda: condition(self.seen), timeout):
        raise AssertionError("no %s within %d s; polls: %s"
                             % (what, timeout, self.seen[-12:]))


def _ran(target, graph, fetch, config):
  """Runs ``fetch`` in a new session; False while the ps cannot serve it."""
  try:
    with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
      sess.run(fetch)
    return True
  except (tf.errors.UnavailableError, tf.errors.AbortedError,
          tf.errors.DeadlineExceededError, tf.errors.CancelledError):
    return False

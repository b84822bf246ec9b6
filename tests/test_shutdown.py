"""Prompt, clean stops: the chief's close() no longer waits for a stuck take.

Stock's chief waits the whole stop_grace_period_secs (120 s by default) in
close(), because its queue-runner thread is blocked in take_grad. Ours ends
at once; ``prompt_stop=False`` keeps stock's behaviour reachable, and both are
tested side by side. Bounds here are hang detectors, not speed measurements.
"""

import contextlib
import logging
import threading
import time

import pytest
import tensorflow as tf

import sync_replicas
import support
from sync_replicas import _runner
from sync_replicas import errors

#: A close that takes longer than this has waited for the grace period
#: (support.STOCK_GRACE_SECS, given to every close that must be prompt) or
#: for the op timeout to end a blocked take.
PROMPT_SECS = support.PROMPT_SECS
GRACE_SECS = support.STOCK_GRACE_SECS
#: A worker still running this long after the chief's end was not ended by
#: the closed token queue: its wait for a token would have ended at the op
#: timeout, with an error.
WORKER_END_SECS = support.OP_TIMEOUT_MS / 1000 / 2


def _train(worker, *, last_step, grace, ready=None, fail_after=None,
           before_close=None):
  """Trains in a ``with`` block as users do; returns (close secs, end time).

  The close time runs from the moment the loop left (normally, by an
  exception in user code, or by OutOfRange from a closed token queue), and
  ``before_close()`` returned if given, to the moment the ``with`` block was
  left.
  """
  stop = tf.compat.v1.train.StopAtStepHook(last_step=last_step)
  left_loop = None
  runs = 0
  try:
    with worker.session(hooks=[stop], stop_grace_period_secs=grace) as sess:
      if ready is not None:
        ready.set()
      try:
        while not sess.should_stop():
          sess.run(worker.train_op)
          runs += 1
          if fail_after is not None and runs >= fail_after:
            raise ValueError("user code failed at run %d" % runs)
        if before_close is not None:
          before_close()
      finally:
        left_loop = time.monotonic()
  finally:
    end = time.monotonic()
  return end - left_loop, end


def _run_cluster(opt_cls, *, workers=3, replicas=2, last_step=15, grace=120,
                 opt_kwargs=None, chief_fail_after=None,
                 chief_before_close=None):
  """Chief first, then the others; returns each worker's (close, end)."""
  cluster = sync_replicas.LocalCluster(num_workers=workers, num_ps=1)
  built = [support.LinearWorker(opt_cls, cluster, t, replicas=replicas,
                                total=workers, opt_kwargs=opt_kwargs)
           for t in range(workers)]
  ready = threading.Event()
  chief = support.BoundedThread(
      lambda: _train(built[0], last_step=last_step, grace=grace, ready=ready,
                     fail_after=chief_fail_after,
                     before_close=chief_before_close), name="chief")
  chief.start()
  assert ready.wait(30), "the chief did not create its session"
  others = [support.BoundedThread(
      lambda w=w: _train(w, last_step=last_step, grace=grace),
      name="worker%d" % w.task) for w in built[1:]]
  for t in others:
    t.start()
  return chief, others


def test_chief_close_is_prompt_and_workers_exit_cleanly():
  chief, others = _run_cluster(support.OURS, grace=GRACE_SECS)
  chief_close, chief_end = chief.finish(timeout=60)
  assert chief_close < PROMPT_SECS, (
      "close() took %.1fs: it waited for the grace period or an op "
      "timeout" % chief_close)
  for t in others:
    _, end = t.finish(timeout=30)  # Re-raises any exception in user code.
    assert end - chief_end < WORKER_END_SECS


def test_a_lone_chief_closes_promptly_where_stocks_waits():
  # The mirror of test_stock_behaviour_waits_for_the_grace_period: after the
  # chief's last update nothing pushes, so a runner blocked in take_grad
  # cannot be freed by a late push, as it can with workers still training.
  chief, _ = _run_cluster(support.OURS, workers=1, replicas=1,
                          grace=GRACE_SECS)
  chief_close, _ = chief.finish(timeout=GRACE_SECS + 60)
  assert chief_close < PROMPT_SECS, (
      "close() took %.1fs: it waited for the grace period or an op "
      "timeout" % chief_close)


def test_chief_failure_in_user_code_stops_everyone_promptly():
  chief, others = _run_cluster(support.OURS, grace=GRACE_SECS,
                               last_step=10_000,
                               chief_fail_after=5)
  with pytest.raises(ValueError, match="user code failed at run 5"):
    chief.finish(timeout=60)
  # The chief's close closed the token queue: the others end normally.
  for t in others:
    t.finish(timeout=30)


@pytest.mark.parametrize("impl_name", ["stock", "ours_prompt_stop_off"])
def test_stock_behaviour_waits_for_the_grace_period(impl_name):
  cls, kwargs = {"stock": (support.STOCK, None),
                 "ours_prompt_stop_off": (support.OURS,
                                          {"prompt_stop": False,
                                           "data_end": "stock"})}[impl_name]
  # The chief alone: after its last update nothing pushes, so a late push
  # cannot free stock's runner from take_grad (with other workers still
  # pushing one may: a timing race, which made this test fail under load).
  # The chief stops only once the runner is inside that take: a starved
  # runner thread still between two runs would see the stop and end at
  # once (CI had it, with a second cluster beside it).
  before = set(threading.enumerate())
  chief, others = _run_cluster(
      cls, workers=1, replicas=1, grace=3, opt_kwargs=kwargs,
      chief_before_close=lambda: support.wait_for_stock_runner_to_block(
          [t for t in threading.enumerate() if t not in before]))
  assert not others
  chief_close, _ = chief.finish(timeout=60)
  assert chief_close >= 2.5, "expected stock's wait for the grace period"


def test_in_process_master_stops_promptly_and_trains():
  """master='' (a single-process run): no second session can share state."""
  worker = support.LinearWorker(support.OURS, None, 0, replicas=1, total=1,
                                num_ps=0, target="")
  close_secs, _ = _train(worker, last_step=30, grace=GRACE_SECS)
  assert close_secs < PROMPT_SECS


def test_supervisor_stop_is_prompt():
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  worker = support.LinearWorker(support.OURS, cluster, 0, replicas=1, total=1)
  opt = worker.opt
  with worker.graph.as_default():
    init_tokens = opt.get_init_tokens_op()  # Supervisor finalizes the graph.
    sv = tf.compat.v1.train.Supervisor(
        is_chief=True, logdir=None,
        init_op=tf.compat.v1.global_variables_initializer(),
        local_init_op=opt.chief_init_op,
        ready_for_local_init_op=opt.ready_for_local_init_op,
        recovery_wait_secs=1, global_step=worker.global_step,
        save_model_secs=0, save_summaries_secs=0)
    sess = sv.prepare_or_wait_for_session(worker.target,
                                          config=support.session_config())
    sv.start_queue_runners(sess, [opt.get_chief_queue_runner()])
    sess.run(init_tokens)
    for _ in range(6):
      sess.run(worker.train_op)
    support.wait_until(lambda: sess.run(worker.global_step) >= 3, timeout=20,
                       what="global_step >= 3")
    start = time.monotonic()
    sv.stop()  # Default grace: support.STOCK_GRACE_SECS.
    assert time.monotonic() - start < PROMPT_SECS


def test_stall_is_logged_and_times_out_with_a_clear_error(caplog):
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  chief = support.LinearWorker(
      support.OURS, cluster, 0, replicas=2, total=2,
      opt_kwargs={"stall_log_secs": 0.3, "stall_timeout_secs": 1.5})
  caplog.set_level(logging.WARNING, logger="sync_replicas")
  start = time.monotonic()
  with pytest.raises(sync_replicas.SyncStallError,
                     match=r"No update for \d+ s \(stall_timeout_secs=1.5\): "
                           r"update to step 1 waits for gradients: w 0/2"):
    with chief.session(stop_grace_period_secs=GRACE_SECS) as sess:
      # Nobody pushes: the chief only waits (bounded) for the stop.
      support.wait_until(sess.should_stop, timeout=20,
                         what="the stall timeout to stop the session")
  # Stopped by the timeout, the close is prompt: not the grace's wait.
  assert time.monotonic() - start < PROMPT_SECS
  stalls = [r.getMessage() for r in caplog.records
            if "no update for" in r.getMessage()]
  # No spare initial token: data_end="train_all" gives none on a first start.
  assert stalls and "w 0/2" in stalls[0] and "0 token(s) queued" in stalls[0]


# What the soak's worker 2 raised in CI (TF 2.21) when ps 1 restarted under a
# step: the cancelled partition's root error sorts first and gives its code.
RESTART_AS_CANCELLED = """Graph execution error:

=====================
CANCELLED: From /job:worker/replica:0/task:2:
RecvFromRemoteAsync is cancelled.
	 [[{{node global_step/Read/ReadVariableOp_S39}}]]
ABORTED: From /job:ps/replica:0/task:1:
Session handle is not found: 859886386b42b66c. Possibly this worker ("/job:ps/replica:0/task:1") just restarted.
====================="""
# The same in 2.15's layout of several root errors.
RESTART_AS_CANCELLED_215 = """Graph execution error:

2 root error(s) found.
  (0) CANCELLED: From /job:worker/replica:0/task:2:
RecvFromRemoteAsync is cancelled.
  (1) UNAVAILABLE: From /job:ps/replica:0/task:1:
Socket closed
0 successful operations."""
# A take cancelled because the chief's session closed at the end: no restart.
CLOSED_AT_END = """Graph execution error:

Detected at node 'sync_token_q_Dequeue' defined at (most recent call last):
Dequeue operation was cancelled
	 [[{{node sync_token_q_Dequeue}}]]"""


@pytest.mark.parametrize("error,recoverable", [
    (tf.errors.AbortedError(None, None, "session handle not found"), True),
    (tf.errors.UnavailableError(None, None, "Socket closed"), True),
    (tf.errors.CancelledError(None, None, RESTART_AS_CANCELLED), True),
    (tf.errors.CancelledError(None, None, RESTART_AS_CANCELLED_215), True),
    (tf.errors.CancelledError(None, None, CLOSED_AT_END), False),
    (tf.errors.CancelledError(None, None, "Session has been closed."), False),
    # A message that merely mentions an abort is not a root error.
    (tf.errors.CancelledError(None, None, "cancelled; see ABORTED: above"),
     False),
    (tf.errors.InvalidArgumentError(None, None, "ABORTED: in a feed"), False),
    (errors.SyncStallError("no update"), False),
    (ValueError("UNAVAILABLE:"), False),
])
def test_is_recoverable_error_sees_a_restart_reported_as_cancelled(
    error, recoverable):
  assert sync_replicas.is_recoverable_error(error) is recoverable


@pytest.mark.parametrize("error,recovering", [
    (None, False),
    (tf.errors.UnavailableError(None, None, "ps 1 unreachable"), True),
    (tf.errors.AbortedError(None, None, "session handle not found"), True),
    (tf.errors.InvalidArgumentError(None, None, "a bad feed"), False),
    (errors.SyncStallError("no update"), False),
    (tf.errors.CancelledError(None, None, RESTART_AS_CANCELLED), True),
    (tf.errors.CancelledError(None, None, CLOSED_AT_END), False),
])
def test_a_stop_with_an_error_the_session_recovers_from_keeps_the_queue_open(
    error, recovering):
  # The runner's close decides on this whether the stop ends training (the
  # token queue closes, as stock's does) or is MonitoredSession recovering
  # (it stays open for the new session): CI on 2.15 caught the close on a
  # stop whose only trace of the failure was the error in the coordinator.
  coord = tf.compat.v1.train.Coordinator()
  if error is None:
    coord.request_stop()
  else:
    _stop_as_the_runner_does(coord, error)
  assert _runner._recovering(coord) is recovering  # pylint: disable=protected-access


def _stop_as_the_runner_does(coord, error):
  """Stops ``coord`` with ``error`` from an except block, as the runner
  reports (the coordinator keeps sys.exc_info())."""
  try:
    raise error
  except Exception as e:  # pylint: disable=broad-except
    coord.request_stop(e)


class _AbortOnce(tf.compat.v1.train.SessionRunHook):
  """Raises AbortedError from the run after ``at`` runs, once, as a run
  whose ps restarted does; listed first, so no later hook's after_run runs
  (as when the run itself raised)."""

  def __init__(self, at):
    self._at, self._runs, self.raised = at, 0, False

  def after_run(self, run_context, run_values):
    del run_context, run_values
    self._runs += 1
    if self._runs == self._at and not self.raised:
      self.raised = True
      raise tf.errors.AbortedError(None, None, "a ps restarted (test)")


def _train_through_one_abort(cls, *, timeout_ms=support.OP_TIMEOUT_MS):
  """The chief alone, recovering once from an AbortedError; its last step."""
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  chief = support.LinearWorker(cls, cluster, 0, replicas=1, total=1)
  abort = _AbortOnce(at=3)
  with chief.graph.as_default():
    stop = tf.compat.v1.train.StopAtStepHook(last_step=10)
    with support.monitored_session(
        chief.target, is_chief=True, hooks=[abort, chief.hook, stop],
        timeout_ms=timeout_ms) as sess:
      step = 0
      while not sess.should_stop():
        _, step = sess.run([chief.train_op, chief.global_step])
  assert abort.raised
  return step


@pytest.mark.parametrize("cls", [support.STOCK, support.OURS],
                         ids=["stock", "ours"])
def test_a_recovery_whose_old_sync_loop_outlives_the_grace_still_trains(
    cls, monkeypatch):
  # MonitoredSession waits stop_grace_period_secs (1 s here) for the old
  # session's threads, then creates the new session anyway. Our sync loop's
  # session closes in its own thread: when that took longer (a loaded CI
  # machine), the loop's take was still pending on the ps when the new
  # chief_init_op ran; served first, it ate the init's gradient and the init
  # timed out. The close is made slow here so that the race is certain.
  # Stock's thread runs on the chief's session (the slow close is of our
  # loop's own session only); stock cannot recover here at all: its runner
  # closes the token queue on any stop, and the new session's init tokens
  # then fail.
  close = tf.compat.v1.Session.close
  slowed = []

  def slow_close(session):
    # The runner's closer thread, found by the name the runner gives it: a
    # renamed thread would make the race go away unnoticed, hence ``slowed``.
    if threading.current_thread().name.startswith("SyncQueueRunnerStop"):
      slowed.append(session)
      time.sleep(3)
    close(session)

  monkeypatch.setattr(tf.compat.v1.Session, "close", slow_close)
  if cls is support.STOCK:
    with pytest.raises(tf.errors.CancelledError,
                       match="'sync_token_q' is closed"):
      _train_through_one_abort(cls, timeout_ms=10_000)
    return
  # Read before the run's update: the last one is 10.
  assert _train_through_one_abort(cls, timeout_ms=10_000) >= 9
  assert slowed, "no close from the runner's closer thread was slowed"


class _SessionsMade(tf.compat.v1.train.SessionRunHook):
  """Every (session, coordinator) a MonitoredSession made, in order."""

  def __init__(self):
    self.made = []

  def after_create_session(self, session, coord):
    self.made.append((session, coord))


#: The op timeout of the test below, and its bound on the recovery: a run
#: waiting out the op timeout cannot pass for a prompt recovery.
WAIT_OUT_MS = 60_000
RECOVERY_SECS = 20


def _pending_and_tokens(chief):
  """The chief's accumulator's fresh gradients and the queued tokens, from a
  session of its own (the status ops only read)."""
  status = chief.opt.get_chief_queue_runner().status
  with tf.compat.v1.Session(chief.target, graph=chief.graph,
                            config=support.session_config()) as sess:
    return tuple(sess.run([status.num_accumulated[0], status.tokens]))


def _global_step(chief):
  """The chief's global step, from a session of its own."""
  with tf.compat.v1.Session(chief.target, graph=chief.graph,
                            config=support.session_config()) as sess:
    return sess.run(chief.global_step)


def test_a_loop_failure_while_the_chief_waits_for_a_token_recovers_at_once():
  # The CI soak (2.15): ps 1 was killed while the chief's run, its push
  # done, waited for a token on ps 0. The loop's take failed on ps 1
  # (UnavailableError to the coordinator) and the token queue was rightly
  # left open, but nothing ended the chief's run: MonitoredSession
  # recovered only at the op timeout, and the workers, waiting for tokens
  # too, died of theirs. The same stop is made here with no ps to kill.
  # The chief alone, 3 gradients per update and 2 tokens after each: its
  # 8th run pushes the 2nd gradient and waits for a token for good. The
  # loop is past its first run then (docs/operations-soak.md, fault 6).
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  chief = support.LinearWorker(support.OURS, cluster, 0, replicas=3, total=2)
  sessions = _SessionsMade()
  with chief.graph.as_default(), support.monitored_session(
      chief.target, is_chief=True, hooks=[chief.hook, sessions],
      timeout_ms=WAIT_OUT_MS) as sess:

    def train_until_recovered():
      # The recovery builds in the default graph, which is per thread.
      with chief.graph.as_default():
        while len(sessions.made) < 2:
          sess.run(chief.train_op)

    run = support.BoundedThread(train_until_recovered, name="chief-runs")
    run.start()
    support.wait_until(lambda: _pending_and_tokens(chief) == (2, 0),
                       timeout=30, what="the chief out of tokens",
                       interval=0.1)
    _stop_as_the_runner_does(sessions.made[0][1], tf.errors.UnavailableError(
        None, None, "a ps restarted (test)"))
    support.wait_until(
        lambda: len(sessions.made) == 2, timeout=RECOVERY_SECS,
        what="the chief's new session: its run still waits for a token")
    # The run in flight, retried on the new session (no checkpoint: the
    # model is initialized again), took one of its init tokens.
    run.finish(timeout=WAIT_OUT_MS / 1000)
    for _ in range(2):
      sess.run(chief.train_op)
    # Those runs returned on init tokens, so nothing waited for the update
    # their 3 gradients make: the loop's thread applies it after the third
    # push landed, and a read right away could come first (CI, loaded). The
    # wait ends when the loop applied it; it never does if the recovered
    # loop is not taking, the defect this test exists to catch.
    support.wait_until(lambda: _global_step(chief) >= 1, timeout=30,
                       what="the recovered loop's first update")
    assert _global_step(chief) == 1


class _FailsDuringCreation(tf.compat.v1.train.SessionRunHook):
  """Listed after the sync hook: in the first session's creation, stops the
  coordinator as the loop does when a ps is still down, waits until the
  runner has either closed the session (the bug) or said it waits for the
  first run (the fix), then runs in the session, as a later hook may (the
  soak's reads the global step)."""

  def __init__(self, global_step, said):
    self._global_step, self._said = global_step, said
    self.sessions = 0

  def after_create_session(self, session, coord):
    self.sessions += 1
    if self.sessions > 1:
      return
    _stop_as_the_runner_does(coord, tf.errors.UnavailableError(
        None, None, "a ps is still down (test)"))
    support.wait_until(
        lambda: getattr(session, "_closed", False) or self._said(),
        timeout=30, what="the runner's decision on the chief's session")
    session.run(self._global_step)


def test_a_loop_failure_while_the_session_is_created_closes_it_at_its_first_run(
    caplog):
  """CI's 2.15 soak: the chief's recreated session started its loop, which
  failed at once (a ps still down), and the runner closed the session while
  a later hook's after_create_session still ran in it: that hook's
  CancelledError came out of MonitoredSession and the chief died. The close
  now waits for the session's first run, which fails into the coordinator's
  error, and MonitoredSession recovers."""
  caplog.set_level(logging.INFO, logger="sync_replicas._runner")
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  chief = support.LinearWorker(support.OURS, cluster, 0, replicas=1, total=1)
  sessions = _SessionsMade()
  failing = _FailsDuringCreation(
      chief.global_step, lambda: "its close waits for its first run"
      in caplog.text)
  with chief.graph.as_default(), support.monitored_session(
      chief.target, is_chief=True, hooks=[chief.hook, failing, sessions],
      timeout_ms=WAIT_OUT_MS) as sess:

    def recovered():
      sess.run(chief.train_op)  # The close lands within a run or two.
      return len(sessions.made) == 2
    support.wait_until(recovered, timeout=RECOVERY_SECS,
                       what="the chief's new session, after its first run")
    assert failing.sessions == 2
    assert "closing the chief's session" in caplog.text
    sess.run(chief.train_op)


@contextlib.contextmanager
def _initialized_chief(session_cls=tf.compat.v1.Session):
  """A plain chief session, initialized, on a cluster of its own: yields
  (runner, session). Two replicas to aggregate and nobody pushing, so the
  loop, once started, blocks in a take."""
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  chief = support.LinearWorker(support.OURS, cluster, 0, replicas=2, total=2)
  with chief.graph.as_default():
    init = [tf.compat.v1.global_variables_initializer(),
            tf.compat.v1.local_variables_initializer()]
  with session_cls(chief.target, graph=chief.graph,
                   config=support.session_config()) as sess:
    sess.run(init)
    sess.run(chief.opt.chief_init_op)
    yield chief.opt.get_chief_queue_runner(), sess


def test_waiting_for_earlier_sessions_ends_when_their_loop_ends():
  with _initialized_chief() as (runner, sess):
    assert runner.wait_for_earlier_sessions(0)  # No loop yet.
    coord = tf.compat.v1.train.Coordinator()
    threads = runner.create_threads(sess, coord, daemon=True, start=True)
    assert not runner.wait_for_earlier_sessions(0.5)
    coord.request_stop()
    assert runner.wait_for_earlier_sessions(30), "the loop did not end"
    coord.join(threads, stop_grace_period_secs=30)


class _RecordingSession(tf.compat.v1.Session):
  """A session that notes every fetch it was asked to run, and from which
  thread."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.fetched = []

  def run(self, fetches, *args, **kwargs):
    self.fetched.append((threading.current_thread().name, fetches))
    return super().run(fetches, *args, **kwargs)


def test_the_stops_readiness_read_is_warmed_before_any_stop():
  # A fetch the master has not run costs a prune of the whole graph (0.8 s
  # at 1000 variables): paid at the stop, it made Coordinator.join wait out
  # the whole grace period. The closer runs the read once while training.
  with _initialized_chief(_RecordingSession) as (runner, sess):
    coord = tf.compat.v1.train.Coordinator()
    threads = runner.create_threads(sess, coord, daemon=True, start=True)
    warmed = lambda: any(
        name.startswith("SyncQueueRunnerStop") and fetches is runner.status.ready
        for name, fetches in sess.fetched)
    try:
      support.wait_until(warmed, timeout=20,
                         what="the closer's warm-up read of status.ready")
    finally:
      coord.request_stop()
      coord.join(threads, stop_grace_period_secs=30)


class _FakeClock:

  def __init__(self):
    self.now = 100.0
    self.slept = []

  def __call__(self):
    return self.now

  def sleep(self, secs):
    self.slept.append(secs)
    self.now += secs


def test_the_close_lets_a_run_that_just_began_settle_first():
  # A cancel that reaches the ps before the take's call has its cancel
  # callback is lost, and the take stays pending there (1 in 800 stops
  # right after an update, measured): the loop's session closes only once
  # the run in flight is CANCEL_SETTLE_SECS old.
  clock = _FakeClock()
  in_flight = _runner.RunInFlight(clock=clock, sleep=clock.sleep)
  in_flight.settle(1.0)
  assert not clock.slept  # No run in flight: nothing to wait for.

  def run():
    clock.now += 0.3  # The closer looks 0.3 s into the run.
    in_flight.settle(1.0)
    return clock.now

  assert in_flight.run(run) == pytest.approx(101.0)  # 1 s after it began.
  assert max(clock.slept) <= 0.01 + 1e-9  # In short naps, not one sleep.
  clock.slept.clear()

  def old_run():
    clock.now += 5.0  # Long under way: its cancel callback is set.
    in_flight.settle(1.0)

  in_flight.run(old_run)
  assert not clock.slept


def test_the_loop_session_renews_until_its_closer_closes_it():
  # The polling loop's blocking start cancels its take once by renewing
  # the loop's session; the closer must then close the new one, and a
  # renew after the closer's close must not open a session nobody closes.
  clock = _FakeClock()
  in_flight = _runner.RunInFlight(clock=clock, sleep=clock.sleep)
  first = tf.compat.v1.Session(graph=tf.Graph())
  loop_sess = _runner.LoopSession(first, in_flight)
  second = loop_sess.renew()
  assert second is not first and loop_sess.session is second
  with pytest.raises(RuntimeError, match="closed Session"):
    first.run([])
  loop_sess.close()
  with pytest.raises(RuntimeError, match="closed Session"):
    second.run([])
  assert loop_sess.renew() is None


def test_a_recovery_from_an_error_in_a_run_keeps_the_token_queue_open():
  # MonitoredSession recreates its session for an AbortedError raised by a
  # run; the coordinator's stop then carries no error and every ps is
  # readable. The runner closed the token queue on that stop (the gap left
  # open in docs/operations-soak.md, fault 1): the new session's init tokens
  # then went into a closed queue and training ended there.
  assert _train_through_one_abort(support.OURS) >= 9

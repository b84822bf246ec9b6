"""The chief's sync loop: a QueueRunner that stops when asked to.

Stock runs the chief's aggregate-apply-release op in a QueueRunner thread on
the chief's own session. After the last worker step nothing pushes gradients,
so the thread stays blocked inside ``take_grad``, where it cannot see a stop
request; ``MonitoredSession.close()`` then waits the whole
``stop_grace_period_secs`` (120 s by default) before closing the session
cancels it, and the dying thread prints a CancelledError traceback.

``SyncQueueRunner`` is a real ``QueueRunner`` over the same token queue and op
(so Supervisor's ``start_queue_runners`` and stock's graph are unchanged) that
avoids the wait:

* against a remote master (``grpc://...``, every between-graph job) it runs
  the loop on a session of its own to the same target; when the coordinator
  stops it closes the token queue (workers waiting for a token end with
  OutOfRange, a normal end for MonitoredSession) and then its own session,
  which cancels a blocked take at once; the queue stays open when a ps task
  is unreachable or was restarted, for that stop is MonitoredSession
  recovering the chief's session, not the end of training;
* against an in-process master (``''``) a second session would not share the
  accumulators, so it runs the op only once every accumulator already holds
  enough gradients (a read-only check, polled with a bounded wait), and
  checks for a stop between polls.

All of this needs a coordinator, the only way to ask for a stop: called
without one (a plain Session script's ``create_threads(sess)``), the runner
makes stock's QueueRunner threads instead. A chief session closed without a
stop request ends the remote loop as it ends stock's thread.

With an aggregation deadline (``min_replicas_to_aggregate``) the loop polls
the accumulators' counts instead of blocking in ``take_grad``: it runs the
sync op with the full count as soon as every accumulator has it, or, once the
deadline since the last update passed, with whatever every accumulator holds
if that reaches the minimum (fed as the takes' ``num_required``). A take never
blocks then, and never sees fewer gradients than the poll did: only the
chief's own takes lower a count.

With a checkpoint listener (``make_checkpoint_saver_listener``, ``_saves``)
every update runs under a lock that a save holds, and the remote loop polls
as the in-process one does, so that it never holds a save up while blocked
in a take. Both sleep through the first part of each gather before polling
(``QuietStart``).

It also starts the stall watch beside its loop (``_stall_watch``): while no
update lands, the watch logs at a steady cadence what the update waits for,
and with a stall timeout, or shortly before the operation timeout when a
worker the update needs cannot push, it stops the coordinator.
"""

import collections
import logging
import threading
import time

import tensorflow as tf

from sync_replicas import _compat
from sync_replicas import _data_end
from sync_replicas import _saves
from sync_replicas import _stall_watch
from sync_replicas import _timeline
from sync_replicas import errors

_LOG = logging.getLogger(__name__)

#: How often the in-process runner re-checks the accumulators, in seconds.
LOCAL_POLL_SECS = 0.002
#: After an update, the polling loop first sleeps this fraction of the
#: shortest of the last ``QUIET_HISTORY`` gathers (update to every
#: accumulator ready), then polls (``QuietStart``).
QUIET_FRACTION = 0.5
QUIET_HISTORY = 8
#: The longest such sleep, in seconds: a gather this long is seconds of
#: training, where a poll every LOCAL_POLL_SECS costs nothing noticeable.
QUIET_MAX_SECS = 1.0
#: Bound on closing the token queue at stop: a ps that died (the usual reason
#: for a recovery close) must not hold the chief's close for long.
CLOSE_QUEUE_TIMEOUT_MS = 5000
#: How often the remote runner checks whether the chief's own session was
#: closed without a stop request, in seconds.
SESSION_CHECK_SECS = 0.5
#: How often the polling loop's blocking start (``PollingLoop``) reads the
#: workers done, in seconds: a worker done waits at most this (plus the
#: settle below) for the update that no longer needs its gradient.
DONE_WATCH_SECS = 0.1
#: Bound on opening the session that replaces a cancelled one, in seconds.
RENEW_WAIT_SECS = 10.0
#: How long a blocking run of the sync op must have been under way before its
#: session is closed (``RunInFlight``), in seconds.
CANCEL_SETTLE_SECS = 0.25
#: How long the close of a chief's session that is still being created waits
#: for its first run (``_cancel_the_chiefs_runs``), and how often it looks.
#: Hooks' session set-up (a checkpoint save) can take seconds on a loaded
#: machine; past this the session is left open, its runs then end at the op
#: timeout as before.
FIRST_RUN_WAIT_SECS = 60
FIRST_RUN_POLL_SECS = 0.05


def _requested_error(coord):
  """The error ``coord`` was stopped with, or None."""
  try:
    coord.raise_requested_exception()
  except Exception as e:  # pylint: disable=broad-except
    return e
  return None


def _recovering(coord):
  """Whether ``coord`` was stopped with an error a new session recovers from.

  That includes a restart TensorFlow reports as a CancelledError
  (``errors.is_recoverable_error``): MonitoredSession then ends the
  process rather than recovering, and the chief that restarts needs the
  token queue open as much as a recreated session does. CI (2.15) saw a
  stop of this kind: ps 1 restarted, ps 0's channel to it still backing
  off, the runner's take failed with UnavailableError, and by the stop
  every accumulator was readable again from the chief.
  """
  error = _requested_error(coord)
  return error is not None and errors.is_recoverable_error(error)


def _cancel_the_chiefs_runs(sess, state, *, superseded,
                            timeout=FIRST_RUN_WAIT_SECS):
  """Closes the chief's session: its run in flight, or its next one,
  raises at once, and MonitoredSession recovers on the coordinator's error
  (or, for a restart reported as a CancelledError, ends the process, as it
  would have after the wait).

  Never while the session is still being created: MonitoredSession turns a
  run's error into the coordinator's only inside a run, so a close during a
  later hook's ``after_create_session`` (this loop starts in ours, and can
  fail at once with a ps still down) raised that hook's CancelledError out
  of MonitoredSession and ended the chief (CI's 2.15 soak). The close then
  waits for the session's first run (``state.ran``), at most ``timeout``
  seconds, and is skipped if the session closes meanwhile or a newer one
  is followed (``superseded()``: its creation failed and MonitoredSession
  made another).

  Only for a session our hook follows, so under a MonitoredSession, which
  recreates the session on that error anyway. The loop's take failed (a
  ps restarted) while the chief's own run had pushed and waited for a
  token on a ps that did not fail; a run that starts after the stop does
  the same, as MonitoredSession checks the coordinator only when asked
  whether to stop or when a run fails. With the queue left open and no
  loop to fill it, such a run would end only at the op timeout, and the
  workers, waiting for tokens too, would die of theirs meanwhile (the CI
  soak saw it, TF 2.15). The recovered session's init tokens release them.
  """
  if not state.ran:
    _LOG.info("sync_replicas: the chief's session is still being created: "
              "its close waits for its first run")
    deadline = time.monotonic() + timeout
    while not state.ran and time.monotonic() < deadline:
      if _compat.session_closed(sess) or superseded():
        return
      time.sleep(FIRST_RUN_POLL_SECS)
    if not state.ran:
      _LOG.info("sync_replicas: no run of the chief's session in %d s: "
                "left open", timeout)
      return
  _LOG.info("sync_replicas: closing the chief's session, whose runs would "
            "otherwise wait for a token until the op timeout")
  sess.close()


class ChiefRunState:
  """What the chief's hook saw of its session's runs, for the runner's stop.

  ``in_run``: a run began and neither returned nor raised into the hook's
  ``after_run`` yet; ``ran``: a run began, so the session's creation (every
  hook's ``after_create_session``) is over; ``ended``: the hook's ``end()``
  ran, which
  MonitoredSession does only when training ends, never when it recreates
  the session after an error in a run.
  """

  def __init__(self):
    self.in_run = False
    self.ran = False
    self.ended = False


class RunInFlight:
  """When the sync loop's current blocking run began, for the thread that
  closes the loop's session.

  Closing a session cancels its runs. A ps task hears of the cancel through
  the RunGraph call's cancel callback, which its worker service sets only
  once the call's handler got a thread; a cancel that arrives before that is
  lost, and the take stays pending on the ps with no session behind it. An
  accumulator serves takes in arrival order, so that orphan is served before
  every later take, and eats the gradient a restarted chief's init pushes
  to clear leftovers: the init then waits until the op timeout. A stop
  right after an update lands in that window (the loop's next take has
  just gone out): CI saw it in MonitoredSession's recovery, and stopping a
  loop right after an update orphaned 1 take in 800 here. A run whose call
  went out long enough ago has its callback set, so the closer waits until
  the run in flight (if any) is ``CANCEL_SETTLE_SECS`` old.
  """

  def __init__(self, clock=time.monotonic, sleep=time.sleep):
    self._clock, self._sleep = clock, sleep
    self._lock = threading.Lock()
    self._since = None

  def run(self, fn):
    """``fn()``, noting when it began until it returns."""
    with self._lock:
      self._since = self._clock()
    try:
      return fn()
    finally:
      with self._lock:
        self._since = None

  def settle(self, secs):
    """Returns once no run is in flight or the one in flight is ``secs`` old
    (at most ``secs`` from now)."""
    while True:
      with self._lock:
        since = self._since
      if since is None:
        return
      left = since + secs - self._clock()
      if left <= 0:
        return
      self._sleep(min(left, 0.01))


class QuietStart:
  """How long the polling loop may sleep after an update before it polls.

  The next update cannot be ready before the workers have their tokens,
  computed and pushed, which takes about as long each time. Polling every
  LOCAL_POLL_SECS through all of that cost the chief and every ps a run
  per poll: with a checkpoint listener, about a tenth of the CPU of the
  soak's chief and 2 ps tasks (halving the polls saved 2-3 of their 40
  CPU-seconds per 30 s, tools/soak without faults). So the loop first sleeps
  ``QUIET_FRACTION`` of the shortest recent gather (time from an update's
  end until the poll that found every accumulator ready) and polls only
  after that.

  An update is then late only if its gather is less than that fraction of
  the shortest of the last ``QUIET_HISTORY``; a gather measured after a
  sleep is at least the sleep, so a cluster that speeds up brings the sleep
  down by that fraction per update. No history (the first update, or a
  loop whose updates are ready at once) means no sleep.
  """

  def __init__(self, clock=time.monotonic, fraction=QUIET_FRACTION,
               history=QUIET_HISTORY, max_secs=QUIET_MAX_SECS):
    self._clock, self._fraction, self._max = clock, fraction, max_secs
    self._gathers = collections.deque(maxlen=history)
    self._since = None

  def ready(self):
    """Notes that every accumulator is ready; an update runs next."""
    if self._since is not None:
      self._gathers.append(self._clock() - self._since)
      self._since = None

  def updated(self):
    """Notes that an update ended; returns how long to sleep before polling."""
    self._since = self._clock()
    if not self._gathers:
      return 0.0
    return min(self._fraction * min(self._gathers), self._max)


def warm_up(sess, fetch):
  """Runs ``fetch`` once, bounded, so that its first-run cost is paid now.

  A fetch the master has not run yet costs a prune of the whole graph first
  (0.8 s for the readiness read at 1000 variables here, 3 ms once known).
  The closer's stop reads readiness: paid there, that came on top of the
  close, and Coordinator.join, which sleeps in doubling steps, waited out
  the whole grace period (2.2 s chief closes in tools/bench at V = 1000).
  Bounded like the stop's own reads, so a ps that is not up yet costs only
  the warm-up. A failure is only logged (debug): the stop then pays the
  prune itself, as before.
  """
  options = tf.compat.v1.RunOptions(timeout_in_ms=CLOSE_QUEUE_TIMEOUT_MS)
  try:
    sess.run(fetch, options=options)
  except Exception as e:  # pylint: disable=broad-except
    _LOG.debug("warming up %s: %s", getattr(fetch, "name", fetch), e)


class LoopSession:
  """The sync loop's own session, shared by the loop and its closer.

  Closing it first lets the run in flight settle (``RunInFlight``). The
  polling loop's blocking start (``PollingLoop``) also cancels its runs
  once, by ``renew``: the session is closed and another opened in its
  place, unless the closer closed it for good first.
  """

  def __init__(self, session, in_flight, *, config=None):
    self._session, self._in_flight = session, in_flight
    self._config = config
    self._lock = threading.Lock()
    self._closed = False

  @property
  def session(self):
    with self._lock:
      return self._session

  def close(self):
    with self._lock:
      self._closed = True
      session = self._session
    self._in_flight.settle(CANCEL_SETTLE_SECS)
    session.close()

  def renew(self):
    """Cancels the runs in flight (closing their session) and returns the
    session opened in its place; None once ``close`` was called."""
    self._in_flight.settle(CANCEL_SETTLE_SECS)
    with self._lock:
      if self._closed:
        return None
      old = self._session
      self._session = tf.compat.v1.Session(
          old.sess_str, graph=old.graph, config=self._config)
    old.close()
    return self._session


class _DoneWatch:
  """The polling loop's watcher while it blocks (``PollingLoop``): reads
  the workers done every ``DONE_WATCH_SECS`` and, once ``switches(done)``,
  renews the loop's session, which cancels the blocked take."""

  def __init__(self, loop_sess, read_done, switches, coord):
    self._loop_sess, self._read_done = loop_sess, read_done
    self._switches, self._coord = switches, coord
    self._lock = threading.Lock()
    self._quit = threading.Event()
    self._renewed = threading.Event()
    self._session = None
    #: Set once the watcher decided to renew: the loop starts no more runs.
    self.switching = threading.Event()

  def run(self):
    while not self._coord.wait_for_stop(DONE_WATCH_SECS):
      try:
        done = self._read_done()
      except Exception as e:  # pylint: disable=broad-except
        # Closed on a stop, or a ps went away: the loop's run fails too.
        _LOG.debug("the sync loop's watch for workers done ends: %s", e)
        return
      if not self._switches(done):
        continue
      with self._lock:
        if self._quit.is_set():
          return
        self.switching.set()
      _LOG.info("sync_replicas: %d worker(s) done (or gone: "
                "worker_gone_secs): the sync loop leaves its blocked take "
                "and polls from now on", done)
      self._session = self._loop_sess.renew()  # None: closed for good.
      self._renewed.set()
      return

  def switched(self):
    """Whether the watcher switched; if not, it never will (the loop is
    leaving for another reason)."""
    with self._lock:
      if not self.switching.is_set():
        self._quit.set()
      return self.switching.is_set()

  def renewed_session(self):
    """The session that replaced the cancelled one (None: the closer
    closed it first); bounded, the renew waits at most the settle."""
    if not self._renewed.wait(CANCEL_SETTLE_SECS + RENEW_WAIT_SECS):
      raise RuntimeError(
          "sync_replicas: the sync loop's session was not renewed within "
          "%.0f s after a worker was done" % (
              CANCEL_SETTLE_SECS + RENEW_WAIT_SECS))
    return self._session


class BlockingLoop:
  """Stock's loop: run the sync op, whose takes block until enough arrived.

  Against a remote master the op simply runs again and again (closing the
  runner's own session cancels a blocked take); in process it runs only once
  every accumulator is ready (``StatusOps.ready``), polled.
  """

  #: The chief's threads end without a coordinator too (stock's threads).
  needs_coordinator = False
  #: Every update waits for replicas_to_aggregate: none is counted early.
  by_deadline = None
  #: Workers that are done change nothing.
  data_end = None
  #: No worker is declared gone (worker_gone_secs needs a data_end record).
  gone = None

  def run_remote(self, runner, loop_sess, coord, in_flight):
    sess = loop_sess.session
    if runner.updates.pauses_for_saves:
      # A save may hold the updates back (make_checkpoint_saver_listener):
      # the op then runs only once it cannot block, as in process, so that
      # it never waits for gradients while it keeps a save waiting.
      self.run_local(runner, sess, coord)
      return
    # From the second run on, a run's calls go out at its start, so its age
    # is theirs (RunInFlight). The first also prunes and registers the
    # graph first (make_callable does not, measured on a remote master), so
    # it looks older than its calls: a stop in its first second may still
    # lose a cancel (docs/operations-soak.md, fault 6).
    run_sync = runner.sync_callable(sess)
    while not coord.should_stop():
      in_flight.run(run_sync)

  def run_local(self, runner, sess, coord):
    is_ready = sess.make_callable(runner.status.ready)
    run_sync = runner.sync_callable(sess)
    quiet = QuietStart(clock=runner.clock)
    while not coord.should_stop():
      if is_ready():
        quiet.ready()
        runner.updates.run(coord, run_sync)
        coord.wait_for_stop(quiet.updated())
      else:
        coord.wait_for_stop(LOCAL_POLL_SECS)


class PollingLoop:
  """The loop that never blocks in a take (see the module doc).

  Polls the accumulators' counts (and the workers done, with a ``data_end``
  policy) and runs the sync op only once every accumulator holds what the
  update needs, feeding that count to every take; the same way against a
  remote master and in process. Used with an aggregation deadline, with a
  ``data_end`` policy, or both. Errors propagate to the caller, which
  reports them unless stopping.

  Args:
    feeds: The tensors every take reads its count from (our
      ``num_required`` placeholder with a deadline, else stock's constants).
    replicas_to_aggregate: Gradients a full update averages.
    data_end: A ``_data_end.DataEnd`` or None: an update then needs
      ``data_end.need(done)``; once every worker is done what is left is
      applied and the loop idles; with ``"stop_together"`` the first worker
      done ends the job.
    min_replicas: With a deadline, the fewest gradients an update after the
      deadline applies.
    secs: The deadline, counted from the last update; None: no deadline.
    num_required: With a deadline, the placeholder of ``by_deadline``.
    gone: With ``worker_gone_secs``, the ``_gone.Watches`` that make the
      chief's watch for gone workers beside the loop; else None.
  """

  def __init__(self, feeds, *, replicas_to_aggregate, data_end=None,
               min_replicas=None, secs=None, num_required=None, gone=None):
    self.feeds = list(feeds)
    self.data_end = data_end
    self.gone = gone
    self.min_replicas = min_replicas
    self.secs = secs
    self._full = replicas_to_aggregate
    self._num_required = num_required
    # Only a coordinator ends a deadline's loop. Without one (a plain
    # Session script) a data_end loop gives way to stock's threads, whose
    # takes read stock's constants.
    self.needs_coordinator = secs is not None
    # A function for the statistics' count of deadline updates, or None.
    self.by_deadline = self._by_deadline if secs is not None else None

  def _by_deadline(self):
    """A bool tensor: the deadline released this update (fewer were fed)."""
    return tf.less(self._num_required, self._full)

  def run_remote(self, runner, loop_sess, coord, in_flight):
    sess = loop_sess.session
    if (self.secs is None and self.data_end is not None
        and not runner.updates.pauses_for_saves):
      sess = self._block_until_done(runner, loop_sess, coord, in_flight)
      if sess is None:
        return
    self._poll(runner, sess, coord)

  def _switches(self, done):
    """Whether ``done`` workers done ask for polling: a full update may no
    longer come, or the first one done stops the job."""
    ends = self.data_end
    return bool(done) and (ends.policy == _data_end.STOP_TOGETHER
                           or ends.need(done) < self._full)

  def _block_until_done(self, runner, loop_sess, coord, in_flight):
    """Runs stock's blocking loop until a worker is done; returns the
    session to poll on from then on, or None on a stop.

    Polling costs every update a detection delay and a dispatch of the sync
    op after it (the small model at W = 2 lost a third of its updates to
    them), and is needed only once a worker is done: until then every
    update gets its full count, as stock's does. A watcher reads the
    workers done every ``DONE_WATCH_SECS``; once the next full update can
    no longer come (``_switches``), it cancels the blocked take by
    renewing the loop's session. No take can have completed then: the
    gradients for the pending update come from the tokens the last update
    released, one per worker not done, and the done worker's token is never
    used, so no accumulator reaches the full count. (Spare tokens, which a
    restarted chief's init brings, could let one through; the cancel then
    waits until the run is ``CANCEL_SETTLE_SECS`` old.)
    """
    sess = loop_sess.session
    read_done = sess.make_callable(self.data_end.done_count)
    if self._switches(read_done()):
      return sess
    watch = _DoneWatch(loop_sess, read_done, self._switches, coord)
    threading.Thread(target=watch.run, daemon=True,
                     name="SyncQueueRunnerDoneWatch").start()
    run_full = runner.sync_callable(sess)
    try:
      while not coord.should_stop() and not watch.switching.is_set():
        in_flight.run(run_full)
    except Exception:  # pylint: disable=broad-except
      if not watch.switched():
        raise
    if not watch.switched():
      return None
    renewed = watch.renewed_session()
    return None if coord.should_stop() else renewed

  def run_local(self, runner, sess, coord):
    self._poll(runner, sess, coord)

  def _callables(self, runner, sess, coord):
    """``(read, update)``: one poll's read (the global step, the workers
    done with a ``data_end`` policy, the counts), and the run of one update
    of a given count."""
    extra = [self.data_end.done_count] if self.data_end is not None else []
    counts = list(runner.status.num_accumulated)
    if self.secs is None:
      # One accumulator says when the update can go: every gradient in it
      # came from a run that pushes into every accumulator, so the others
      # get theirs (in flight at worst) and their takes wait only for
      # those, as stock's do. A deadline needs every count (the fewest
      # present is what it may apply). Reading them all on every poll cost
      # the chief's loop about half its speed at 200 variables.
      counts = counts[:1]
    read = sess.make_callable([runner.global_step] + extra + counts)
    # Stock's own counts unless fewer are needed: no feed on a full update.
    run_full = runner.sync_callable(sess)
    run_fed = runner.sync_callable(sess, feed_list=self.feeds)
    # No quiet sleep with a deadline: it would move the deadline's polls.
    quiet = QuietStart(clock=runner.clock) if self.secs is None else None

    def update(count):
      if quiet is not None:
        quiet.ready()
      if count == self._full and self.secs is None:
        runner.updates.run(coord, run_full)
      else:
        runner.updates.run(coord, run_fed, *[count] * len(self.feeds))
      if quiet is not None:
        coord.wait_for_stop(quiet.updated())
    return read, update

  def _poll(self, runner, sess, coord):
    ends = self.data_end
    read, update = self._callables(runner, sess, coord)
    last_update = runner.clock()
    while not coord.should_stop():
      step, *counts = read()
      done = counts.pop(0) if ends is not None else 0
      if done:
        # The chief's memory of who is done (``DataEnd.restore``): a read
        # of the record only when it holds someone new.
        ends.remember(sess, done=done)
      have = min(counts)
      full = self._full if ends is None else ends.need(done)
      waited = runner.clock() - last_update
      deadline = self.secs is not None and waited >= self.secs
      if done and ends.policy == _data_end.STOP_TOGETHER:
        runner.end_with_the_data(coord, step=int(step), dropped=have)
        return
      if ends is not None and ends.all_done(done):
        if have > 0:
          _LOG.info("sync_replicas: every worker is done: the last update "
                    "(to step %d) applies the %d gradients left", int(step) + 1,
                    have)
          update(have)
          continue
        coord.wait_for_stop(SESSION_CHECK_SECS)
        continue
      if full and have >= full:
        update(full)
      elif deadline and have >= min(self.min_replicas, full):
        _LOG.info(
            "sync_replicas: no full update for %.2f s "
            "(aggregation_deadline_secs=%s): update to step %d goes ahead "
            "with %d of replicas_to_aggregate=%d gradients", waited,
            self.secs, int(step) + 1, have, full)
        update(have)
      else:
        coord.wait_for_stop(LOCAL_POLL_SECS)
        continue
      last_update = runner.clock()


class SyncQueueRunner(tf.compat.v1.train.QueueRunner):
  """A QueueRunner over the token queue whose threads end promptly on stop.

  Built by ``SyncReplicasOptimizer.apply_gradients``; users get it from
  ``get_chief_queue_runner()``. With ``prompt_stop=False`` it behaves exactly
  as stock's QueueRunner.
  """

  def __init__(self, token_queue, sync_op, *, status, global_step,
               replicas_to_aggregate, local_step=None, prompt_stop=True,
               stall_log_secs=60.0, stall_timeout_secs=None,
               extra_close_op=None, loop=None, timeline=None,
               clock=time.monotonic):
    with _compat.quiet_deprecations():
      super().__init__(token_queue, [sync_op])
    # Closed with the token queue on stop: the workers' own token queues.
    self._extra_close_op = extra_close_op
    # How the chief's thread runs the sync op: BlockingLoop or PollingLoop.
    self._loop = loop if loop is not None else BlockingLoop()
    self.sync_op = sync_op
    self._timeline = timeline
    self.status = status
    self.global_step = global_step
    self.clock = clock
    self.replicas_to_aggregate = replicas_to_aggregate
    self._prompt_stop = prompt_stop
    self._stall_log_secs = stall_log_secs
    self._stall_timeout_secs = stall_timeout_secs
    self._running = set()  # Sessions with live threads, as stock tracks.
    self._guard = threading.Lock()
    self._finished = threading.Condition(self._guard)
    self._run_states = {}  # Session -> its hook's ChiefRunState.
    # Held by an update, and by a save once a checkpoint listener exists.
    self.updates = _saves.UpdateLock(prompt_stop=prompt_stop)
    # Set when data_end="stop_together" ended the job: the stop closes the
    # token queue even while the chief's own run waits for a token.
    self._ended_with_the_data = False
    # When the last update ran (self.clock()), None before the first: what
    # the look before the operation timeout counts from.
    self._updated_at = None
    self._stall = _stall_watch.StallWatch(
        status=status, global_step=global_step,
        replicas_to_aggregate=replicas_to_aggregate, loop=self._loop,
        local_step=local_step, stall_log_secs=stall_log_secs,
        stall_timeout_secs=stall_timeout_secs,
        updated_at=lambda: self._updated_at, clock=clock)

  @property
  def serving(self):
    """True while a sync loop of this runner runs (in the chief's process)."""
    with self._guard:
      return bool(self._running)

  def end_with_the_data(self, coord, *, step, dropped):
    """``data_end="stop_together"``: stops the coordinator; its closer then
    closes the token queue, even under the chief's run, and every worker
    ends (OutOfRange, a normal end) at this global step."""
    _data_end.log_stop_together(step=step, dropped=dropped)
    self._ended_with_the_data = True
    coord.request_stop()

  @property
  def prompt_stop(self):
    return self._prompt_stop

  @property
  def data_end(self):
    """The ``_data_end.DataEnd`` the loop follows; None without a policy."""
    return self._loop.data_end

  def sync_callable(self, sess, feed_list=None):
    """A callable that runs the sync op once, as the loops do (recording the
    update on the timeline, if there is one)."""
    run = _timeline.chief_callable(self._timeline, sess, self.sync_op,
                                   feed_list=feed_list)

    def run_and_note(*feeds):
      run(*feeds)
      self._updated_at = self.clock()
    return run_and_note

  def follow_runs(self, sess, run_state):
    """The hook's view of ``sess``'s runs, read when its threads stop.

    Call before ``create_threads(sess, ...)``. Without it (Supervisor, a
    plain session) the stop decides as before: see the module doc.
    """
    with self._guard:
      self._run_states[sess] = run_state

  def _forget_runs(self, sess):
    """``sess``'s run state (None without a hook), no longer kept."""
    with self._guard:
      return self._run_states.pop(sess, None)

  def create_threads(self, sess, coord=None, daemon=False, start=False):
    """Creates (and optionally starts) the chief's threads for ``sess``.

    Same contract as ``QueueRunner.create_threads``: with a coordinator the
    threads report errors to it and end when it stops; no new threads are
    made while earlier ones for the same session still run. Without a
    coordinator nothing can ask for a stop, so the threads are stock's own
    (a prompt stop needs a coordinator to be prompt about).

    Raises:
      ValueError: Without a coordinator, when an aggregation deadline is set:
        its polling loop needs one to end.
    """
    if coord is None and self._loop.needs_coordinator:
      raise ValueError(
          "The chief queue runner of an optimizer with "
          "aggregation_deadline_secs=%s needs a coordinator, got coord=None. "
          "Pass coord=tf.compat.v1.train.Coordinator() to create_threads "
          "(the hook, Supervisor and MonitoredTrainingSession do)."
          % (self._loop.secs,))
    if not self._prompt_stop or coord is None:
      threads = super().create_threads(sess, coord=coord)
    else:
      threads = self._prompt_threads(sess, coord)
    if coord is not None and threads and self._loop.gone is not None:
      threads += self._loop.gone.threads(sess, coord)  # worker_gone_secs
    if (coord is not None and threads
        and (self._stall_log_secs or self._stall_timeout_secs)):
      threads.append(threading.Thread(
          target=self._stall.watch, args=(sess, coord),
          name="SyncQueueRunnerWatch-%s" % self.name))
      timeout_ms = _compat.operation_timeout_ms(sess)
      # Only our loops note each update (sync_callable), and only against a
      # remote master are there tasks to lose.
      if (self._prompt_stop and sess.sess_str and timeout_ms > 0):
        threads.append(threading.Thread(
            target=self._stall.look_before_timeout,
            args=(sess, coord, timeout_ms),
            name="SyncQueueRunnerTimeout-%s" % self.name))
    for t in threads:
      if coord is not None:
        coord.register_thread(t)  # A set: registering twice is harmless.
      t.daemon = daemon
      if start:
        t.start()
    return threads

  def _prompt_threads(self, sess, coord):
    """The sync loop and its closer, for a session with a coordinator."""
    with self._guard:
      if sess in self._running:
        return []
      self._running.add(sess)
    if not sess.sess_str:
      return [
          threading.Thread(target=self._run_local, args=(sess, coord),
                           name="SyncQueueRunner-%s" % self.name),
          threading.Thread(target=_compat.queue_runner_closer(self),
                           args=(sess, self._close_ops(), coord),
                           name="SyncQueueRunnerStop-%s" % self.name)]
    config = _compat.session_config(sess)
    in_flight = RunInFlight()
    loop_sess = LoopSession(
        tf.compat.v1.Session(sess.sess_str, graph=sess.graph, config=config),
        in_flight, config=config)
    return [
        threading.Thread(target=self._run_remote,
                         args=(sess, loop_sess, coord, in_flight),
                         name="SyncQueueRunner-%s" % self.name),
        threading.Thread(target=self._close_on_stop_remote,
                         args=(sess, loop_sess, coord),
                         name="SyncQueueRunnerStop-%s" % self.name)]

  # ---------------------------------------------------------------- loops

  def _finish(self, sess):
    with self._guard:
      self._running.discard(sess)
      self._finished.notify_all()

  def wait_for_earlier_sessions(self, timeout_secs):
    """Waits until no earlier session's sync loop still runs; False if
    ``timeout_secs`` passed first.

    Call before the chief's init on a new session. MonitoredSession stops
    waiting for the old session's threads after ``stop_grace_period_secs``;
    if the loop's take were still pending on the ps then, it would be served
    before the new ``chief_init_op``'s own take (an accumulator serves takes
    in arrival order), eat that init's gradient and leave the init blocked
    until the op timeout (seen in CI on a loaded machine).
    """
    with self._guard:
      return self._finished.wait_for(lambda: not self._running, timeout_secs)

  def _stopping(self, coord):
    return coord.should_stop()

  def _report(self, coord, error):
    coord.request_stop(error)

  def _close_ops(self):
    if self._extra_close_op is None:
      return self.cancel_op
    return [self.cancel_op, self._extra_close_op]

  def _run_remote(self, sess, loop_sess, coord, in_flight):
    try:
      self._loop.run_remote(self, loop_sess, coord, in_flight)
    except Exception as e:  # pylint: disable=broad-except
      # Closing our session on stop cancels the op: expected, not an error.
      if not self._stopping(coord):
        self._report(coord, e)
    finally:
      self._finish(sess)

  def _close_on_stop_remote(self, sess, loop_sess, coord):
    warm_up(sess, self.status.ready)  # The stop reads it: pay its prune now.
    # Stock's thread runs on the user's session, so closing that session
    # (without a stop request) cancels it; ours runs on its own session,
    # which must then follow, or it would keep taking gradients for good.
    while not coord.wait_for_stop(SESSION_CHECK_SECS):
      if _compat.session_closed(sess):
        _LOG.debug("the chief's session closed without a stop request: "
                    "closing the sync loop's session too")
        self._forget_runs(sess)
        loop_sess.close()
        return
    # Tokens first: workers waiting for one end now instead of at the op
    # timeout. Then our session: that cancels a take blocked on the ps.
    options = tf.compat.v1.RunOptions(timeout_in_ms=CLOSE_QUEUE_TIMEOUT_MS)
    # A token queue closed on a surviving ps stays closed: on a stop that
    # is MonitoredSession recreating the chief's session, every worker
    # would end as if training were done and the recovered chief could not
    # enqueue its tokens (issue 20). Such a stop carries an error
    # MonitoredSession recovers from, or leaves a ps task unreachable or
    # restarted (its accumulators unreadable on this session).
    # Asked first, so that every stop forgets the session's run state.
    state = self._forget_runs(sess)
    if _recovering(coord):
      _LOG.info("sync_replicas: the chief stops on an error its session "
                "recovers from: the token queue stays open for the session "
                "that recovers")
      loop_sess.close()
      if state is not None:
        # Forgotten above: any session still followed is a newer one.
        _cancel_the_chiefs_runs(sess, state,
                                superseded=lambda: bool(self._run_states))
      return
    if (state is not None and state.in_run and not state.ended
        and _requested_error(coord) is None
        and not self._ended_with_the_data):
      # The stop carries no error, and every ps may be readable again: only
      # the hook can tell this from the end of training.
      _LOG.info("sync_replicas: the chief's session stops on an error in a "
                "run, not at the end of training: the token queue stays "
                "open for the session (or chief) that recovers")
      loop_sess.close()
      return
    try:
      sess.run(self.status.ready, options=options)
    except Exception as e:  # pylint: disable=broad-except
      _LOG.info("sync_replicas: the chief stops while a ps task is "
                "unreachable or restarted (%s): the token queue stays open "
                "for the session that recovers", type(e).__name__)
    else:
      self._end_the_job(sess, coord, options)
    loop_sess.close()

  def _end_the_job(self, sess, coord, options):
    """Closes the token queue: every worker's wait for a token ends."""
    error = _requested_error(coord)
    ends = self._loop.data_end
    if error is not None and ends is not None:
      # The job failed: the mark goes first, so that a worker whose run the
      # closed queue ends finds why (``_abort``), not a normal end.
      ends.abort.write(sess, error)
    try:
      sess.run(self._close_ops(), options=options)
    except Exception as e:  # pylint: disable=broad-except
      _LOG.debug("closing the token queue on stop: %s", e)

  def _run_local(self, sess, coord):
    try:
      self._loop.run_local(self, sess, coord)
    except Exception as e:  # pylint: disable=broad-except
      if not self._stopping(coord):
        self._report(coord, e)
    finally:
      self._finish(sess)

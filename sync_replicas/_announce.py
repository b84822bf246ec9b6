"""A worker's announcement that its input ended: one insert into the done
record on the ps (``_data_end.DataEnd``), tried again while the record's
ps task does not answer.

A record that meets that task down or restarting (``UnavailableError``,
``AbortedError``, a timeout) is tried again for at most the session's
``operation_timeout_in_ms`` (the caller's default bound without one): the
task's restart empties the record, and neither the restarted task nor the
chief, which remembers only the ends it saw, would learn this one; every
update would wait for this worker's gradient until the operation timeout.

Every try after the first opens a new session on the same target, graph
and config, and records through it in a thread of its own; the session is
closed after. The old one cannot do it: a ps task that restarted answers
it with ``AbortedError`` for good ("Session handle is not found": its
master made its worker session on the task that died; TensorFlow's
master_session.cc and session_mgr.cc), and while the task was down its
gRPC channel backs off between connection attempts (seen in
test_recovery: still refused 90 s after the ps was back). A new session's
first run waits for the task to answer with no timeout at all (its
CreateSession ignores ``operation_timeout_in_ms``; measured on 2.15 and
2.21), hence the thread: the next try starts after ``WAIT_SECS``, each wait
``BACKOFF`` times longer (a try still waiting may yet get through:
whichever does first counts, and inserting the key twice writes the same
value), and a try still waiting at the bound is left to its daemon thread
and records nothing.
"""

import logging
import queue
import threading
import time

import tensorflow as tf

from sync_replicas import _compat
from sync_replicas import errors

_LOG = logging.getLogger(__name__)

#: The first wait for a try in a new session before the next starts; each
#: wait BACKOFF times longer, at most WAIT_MAX_SECS. A try that reaches the
#: task takes well under a second.
WAIT_SECS = 2.0
BACKOFF = 2.0
WAIT_MAX_SECS = 20.0


class Announcement:
  """The ops a worker records its end with, and the tries that run them.

  Args:
    key, batches: The placeholders of the worker's key and train steps.
    insert: The op inserting them into the done record.
    is_closed: Whether the token queue is closed (the job ended).
    done_count: The workers in the record.
    session_start: An op on the worker's own device: a new session's first
      run, which then waits only for the session's creation (the ps tasks
      answering).
    timeout_ms: Each run's own bound.
    who, where: The worker's name and the record's device, for the lines.
  """

  def __init__(self, *, key, batches, insert, is_closed, done_count,
               session_start, timeout_ms, who, where):
    self._key, self._batches, self._insert = key, batches, insert
    self._is_closed, self._done_count = is_closed, done_count
    self._session_start = session_start
    self._timeout_ms = timeout_ms
    self._who, self._where = who, where

  def record(self, session, key, value, *, bound):
    """The workers done with this one, or None: the job already ended (the
    token queue is closed), or no try got through within ``bound()`` (a
    callable: seconds, and why) while the record's ps task did not
    answer."""
    try:
      return self._once(session, key, value)
    except tf.errors.OpError as e:
      if not retried(e) or not getattr(session, "sess_str", None):
        _LOG.info("sync_replicas: %s could not record that its data ended "
                  "(%s): the job is probably over", self._who,
                  type(e).__name__)
        return None
      return self._again(session, key, value, first=e, bound=bound(session))

  def _once(self, session, key, value):
    options = tf.compat.v1.RunOptions(timeout_in_ms=self._timeout_ms)
    if session.run(self._is_closed, options=options):
      return None
    session.run(self._insert, options=options,
                feed_dict={self._key: key, self._batches: value})
    return int(session.run(self._done_count, options=options))

  def _again(self, session, key, value, *, first, bound):
    """The tries after the first (the module's docstring says how)."""
    limit, why = bound
    _LOG.info("sync_replicas: %s could not record its data end on the ps: "
              "the task of the done record, %s, does not answer (%s); it "
              "tries again for up to %.0f s (%s), each try in a new session",
              self._who, self._where, type(first).__name__, limit, why)
    results, given_up = queue.Queue(), threading.Event()
    start = time.monotonic()
    deadline, wait, error, tries, launch = start + limit, WAIT_SECS, first, 0, True
    while time.monotonic() < deadline:
      if launch:
        tries += 1
        threading.Thread(
            target=self._try_in_new_session,
            args=(session, key, value, results, given_up), daemon=True,
            name="sync_replicas-data-end-%d" % tries).start()
      try:
        done = results.get(
            timeout=max(0.0, min(wait, deadline - time.monotonic())))
      except queue.Empty:
        # No try got through yet: one more, whose channel starts afresh.
        wait, launch = min(wait * BACKOFF, WAIT_MAX_SECS), True
        continue
      if isinstance(done, tf.errors.OpError):
        error, launch = done, False  # The next after a wait for the others.
        if not retried(error):
          break
        continue
      if done is None:
        _LOG.info("sync_replicas: %s did not record its data end: the job "
                  "ended meanwhile (the token queue is closed)", self._who)
      else:
        _LOG.info("sync_replicas: %s recorded its data end on the ps after "
                  "%.1f s (%s; try %d, in a new session)", self._who,
                  time.monotonic() - start, self._where, tries)
      return done
    given_up.set()
    _LOG.warning(
        "sync_replicas: %s gave up recording its data end on the ps after "
        "%.0f s and %d tries (%s): the task of the done record, %s, did not "
        "take it (%s). If the job goes on, every update waits for this "
        "worker's gradient until the operation timeout", self._who,
        time.monotonic() - start, tries, why, self._where,
        type(error).__name__)
    return None

  def _try_in_new_session(self, session, key, value, results, given_up):
    """One of ``_again``'s tries: ``_once`` in a new session like
    ``session`` (closed after), unless ``given_up`` (an Event) is set once
    the session is created; puts its result, or the ``OpError`` it raised,
    in ``results``."""
    config = tf.compat.v1.ConfigProto()
    old = _compat.session_config(session)
    if old is not None:
      config.CopyFrom(old)  # Its device_filters: the ps tasks and this one.
    if config.operation_timeout_in_ms <= 0:
      config.operation_timeout_in_ms = self._timeout_ms
    try:
      fresh = tf.compat.v1.Session(session.sess_str, graph=session.graph,
                                   config=config)
      try:
        # Waits until the ps tasks answer: a try left waiting past the
        # bound records nothing when they do (the worker said it gave up;
        # the address may even serve another job by then).
        fresh.run(self._session_start)
        if not given_up.is_set():
          results.put(self._once(fresh, key, value))
      finally:
        try:
          fresh.close()
        except tf.errors.OpError:
          pass  # A task that went away again does not close it.
    except tf.errors.OpError as e:
      results.put(e)


def retried(error):
  """Whether a record that raised ``error`` is tried again: its ps task did
  not answer (down, too slow) or answered as a restarted task does
  (MonitoredSession's errors, or a CancelledError carrying one:
  ``errors.is_recoverable_error``)."""
  return isinstance(error, tf.errors.DeadlineExceededError) or (
      errors.is_recoverable_error(error))

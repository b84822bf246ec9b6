"""A non-chief's wait for the chief's initialization, bounded, through restarts.

Owns ``wait_for_chief_init``: the poll a non-chief replica runs before its
training session, so that its session manager does not find the model
uninitialized and nap its fixed 30 s (``recovery_wait_secs``) while the
chief, started at the same moment, initializes it.

Each poll that fails opens a new session for the next one, as
MonitoredSession does after an ``AbortedError`` or ``UnavailableError``.
Keeping the session is not enough: a session created with
``device_filters`` (as README's program and the examples create theirs) has
gRPC channels of its own to the ps tasks, and while a ps is down each
channel backs off exponentially between connection attempts (gRPC's default
reaches 120 s), answering every run in between with ``UnavailableError``.
Measured (tests/test_ready.py): a session whose ps was down for a few
seconds went on failing 20-40 s after the ps was back, while a new session
reached it at once; the soak once saw a replica wait its whole 300 s so.
"""

import logging
import time

import tensorflow as tf

_LOG = logging.getLogger(__name__)

#: What a poll may meet while the ps tasks or the chief are not (yet) up, or
#: restart: each opens a new session for the next poll. TensorFlow 2.15
#: reports a restarted ps as the cancelled receive, with its Aborted inside.
RETRIED_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                  tf.errors.AbortedError, tf.errors.CancelledError)


def wait_for_chief_init(
    target: str, ready_op: "tf.Tensor", *,
    config: "tf.compat.v1.ConfigProto | None" = None,
    timeout_secs: float = 600.0, poll_secs: float = 0.5,
    log_secs: float = 30.0, graph: "tf.Graph | None" = None) -> None:
  """Not in stock: blocks until the chief has initialized the model.

  Polls ``ready_op`` (``opt.ready_for_local_init_op``, or any
  ``report_uninitialized_variables`` op) every ``poll_secs`` until it lists
  nothing. A poll that fails because a task is not up, restarted or timed
  out is retried in a new session (see the module's docstring: the old one
  may not answer again for minutes). Logs, every ``log_secs``, that it still
  waits and what its last poll saw. A non-chief calls it before its training
  session: ``wait_for_chief_init(server.target, opt.ready_for_local_init_op,
  config=config)``.

  Args:
    target: This replica's server target.
    ready_op: A string tensor listing what is not initialized yet.
    config: The sessions' ConfigProto; its ``operation_timeout_in_ms``
      bounds each poll and the close of a failed poll's session.
    timeout_secs: How long to wait in all.
    poll_secs: The pause between polls.
    log_secs: How often to log that it still waits (0: never).
    graph: The graph holding ``ready_op``; None: the default graph.

  Raises:
    TimeoutError: The chief did not initialize the model within
      ``timeout_secs``; the message says what the last poll saw.
    ValueError: A bad ``timeout_secs``, ``poll_secs`` or ``log_secs``.
  """
  _check_secs(timeout_secs=timeout_secs, poll_secs=poll_secs,
              log_secs=log_secs)
  start = time.monotonic()
  sess, seen, logged = None, "none ended", start
  try:
    while True:
      if sess is None:
        sess = tf.compat.v1.Session(target, graph=graph, config=config)
      seen = _poll(sess, ready_op)
      if seen is None:
        return
      if seen.startswith(_FAILED):
        _close_quietly(sess)  # The next poll gets a new session.
        sess = None
        seen = seen[len(_FAILED):]
      now = time.monotonic()
      if now - start > timeout_secs:
        raise TimeoutError(
            "The chief did not initialize the model within %.0f s (last "
            "poll: %s). Is the chief task running, and does it reach the ps "
            "tasks?" % (timeout_secs, seen))
      if log_secs and now - logged >= log_secs:
        _LOG.info("sync_replicas: still waiting for the chief after %.0f s; "
                  "last poll: %s", now - start, seen)
        logged = now
      time.sleep(poll_secs)
  finally:
    if sess is not None:
      _close_quietly(sess)


_FAILED = "failed: "


def _check_secs(**bounds):
  for name, value in bounds.items():
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or value < 0):
      raise ValueError("wait_for_chief_init: %s must be a number >= 0 "
                       "(seconds), got %r." % (name, value))


def _poll(sess, ready_op):
  """None once nothing is uninitialized, else what the poll saw (starting
  with ``_FAILED`` if it failed in a way a new session may cure)."""
  try:
    missing = sess.run(ready_op)
  except RETRIED_ERRORS as e:
    return _FAILED + _said(e)
  if not len(missing):  # pylint: disable=g-explicit-length-test
    return None
  return "%d variable(s) not initialized" % len(missing)


def _said(error):
  """The error's type and its first lines that say something (TensorFlow
  opens with "Graph execution error:" and rules of "=" signs)."""
  lines = [line.strip() for line in (error.message or "").splitlines()]
  said = [line for line in lines if line and not line.startswith("=")
          and line != "Graph execution error:"]
  return "%s: %s" % (type(error).__name__, " ".join(said[:2]))


def _close_quietly(sess):
  try:
    sess.close()
  except tf.errors.OpError:
    pass  # A restarted or unreachable ps does not close what it forgot.

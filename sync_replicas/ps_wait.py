"""Owns ``wait_for_job_end``: a hand-started ps task's wait for its job.

A ps task serves as long as its process lives. README's program keeps it
alive until every replica has put an item in a ``done`` queue on the ps;
on a job that failed (the chief stopped it with ``SyncTimeoutError`` or
``SyncStallError``, and every worker exits 1 with that reason) no replica
puts its item, and a ps that waits only for them serves for ever (the
launcher kills it; a hand-started one stays). The chief leaves its reason
on the ps before it closes the token queue (``_abort``'s mark): this wait
reads it too, and raises it, so that the ps ends with the job, failed.
"""

import logging
import time

import tensorflow as tf

from sync_replicas import _abort
from sync_replicas import _checks
from sync_replicas import _tokens

_LOG = logging.getLogger(__name__)

#: Bound on each poll's runs (the queue's size, the mark).
POLL_TIMEOUT_MS = 10_000


def wait_for_job_end(
    target: str, done: "tf.queue.QueueBase", count: int, *,
    config: "tf.compat.v1.ConfigProto | None" = None,
    optimizer_name: str = _tokens.DEFAULT_OPTIMIZER_NAME,
    device: "str | None" = None, poll_secs: float = 0.5,
    linger_secs: float = 5.0) -> None:
  """Not in stock: blocks a ps task until every replica is done, or the
  chief has stopped the job with an error.

  Polls, every ``poll_secs``, the size of ``done`` and the mark the chief
  leaves on the ps when it stops a job that failed. Returns once ``done``
  holds ``count`` items (and takes them); on the mark, serves
  ``linger_secs`` more (the workers whose runs the closed token queue
  ended read the reason from this ps), then raises it::

      sync_replicas.wait_for_job_end(server.target, done, replicas)

  A chief lost for good leaves no mark: the ps then waits, as it would
  without this function, until it is stopped.

  Args:
    target: The ps task's server target.
    done: The queue each replica puts one item into when it is done; in
      the default graph.
    count: Items that mean every replica is done.
    config: The session's ConfigProto (e.g. ``device_filters``).
    optimizer_name: The sync optimizer's ``name``, whose mark to read.
    device: Where the mark lives: the global step's ps task; None: the
      ``done`` queue's device.
    poll_secs: The pause between polls.
    linger_secs: How long the ps serves after the mark appeared.

  Raises:
    SyncTimeoutError, SyncStallError, tf.errors.OpError, RuntimeError: the
      chief stopped the job: its error's class, its reason.
    ValueError: A bad ``count``, ``poll_secs`` or ``linger_secs``.
  """
  _check(count=count, poll_secs=poll_secs, linger_secs=linger_secs)
  mark = _abort.AbortMark(shared_prefix=_tokens.shared_prefix(optimizer_name))
  if device is None:
    device = done.queue_ref.device
  mark.build(device=device, scope="sync_replicas_job_end")
  size, take = done.size(), done.dequeue_many(count)
  bounded = tf.compat.v1.RunOptions(timeout_in_ms=POLL_TIMEOUT_MS)
  with tf.compat.v1.Session(target, config=config) as sess:
    while sess.run(size, options=bounded) < count:
      failed = mark.read(sess, ps=True)
      if failed is not None:
        _LOG.error("sync_replicas: %s; this ps serves %.0f s more, for the "
                   "workers to read it", failed, linger_secs)
        time.sleep(linger_secs)
        raise failed
      time.sleep(poll_secs)
    sess.run(take, options=bounded)


def _check(*, count, poll_secs, linger_secs):
  """Raises ValueError for a bad argument, before any op exists."""
  _checks.positive_int("wait_for_job_end: count", count,
                       "Pass how many replicas put an item in done.")
  for name, value in (("poll_secs", poll_secs), ("linger_secs", linger_secs)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        value < 0 or (name == "poll_secs" and value == 0)):
      raise ValueError("wait_for_job_end: %s must be a number of seconds "
                       "(> 0 for poll_secs, >= 0 for linger_secs), got %r"
                       % (name, value))

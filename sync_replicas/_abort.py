"""The abort mark: why the chief stopped a job that failed.

Owns a one-entry table on the global step's device, in our own name scope
beside the done record (``_data_end``), that the chief writes when its
coordinator stops the job with an error (``SyncStallError``,
``SyncTimeoutError``, an error of its sync loop), just before it closes the
token queue; and the worker's read of it when its train run ended on that
closed queue.

A closed token queue ends a worker's run with ``OutOfRangeError``, which
MonitoredSession takes as a normal end: without the mark a worker of a job
that failed would end as if training were done (exit 0), where stock's
worker, whose chief leaves the queue open, dies at the operation timeout.
With it, the worker's hook stops its coordinator with an error of the
chief's class naming the chief's reason, which MonitoredSession's close
raises. A normal end (a step limit, the data's end, a stop request) writes
no mark and changes nothing.

Like the done record, the table is never checkpointed and lives as long as
that ps task, as does the closed queue: a worker started after the abort
finds the mark too, and so does a chief that starts again, which fails at
its session's start with the same reason instead of the CancelledError its
initial tokens would meet in the closed queue (a new try needs new ps
tasks). Built with a ``data_end`` policy only; in process, with a
Supervisor, or with stock's runner (``prompt_stop=False``) nothing writes it.
"""

import json
import logging

import tensorflow as tf

from sync_replicas import errors

_LOG = logging.getLogger(__name__)

#: Bound on each read or write of the mark.
RUN_TIMEOUT_MS = 5000
#: The table's one key.
_KEY = 0
#: How much of the chief's message the mark keeps.
MAX_MESSAGE_CHARS = 4000


def encode(error):
  """The mark's text for ``error``: its class's name and its message."""
  return json.dumps({"type": type(error).__name__,
                     "message": str(error)[:MAX_MESSAGE_CHARS]})


#: What the error says after the chief's reason: to a worker whose run the
#: closed queue ended, and to a chief that starts again.
_ON_WORKER = ("This worker's run ended on the token queue the chief closed: "
              "the job failed, it did not end")
_ON_CHIEF = ("This chief started again, but that token queue on the ps stays "
             "closed and no token can be released: try again with new ps "
             "tasks (restart the whole job; a checkpoint directory resumes "
             "it)")


#: What the error says after the chief's reason, to a hand-started ps task
#: that served the job (``ps_wait.wait_for_job_end``).
_ON_PS = ("This ps task served the job until it failed, and ends with it "
          "(it ended, it did not succeed)")


def decode(text, *, chief=False, ps=False):
  """The error a worker (or a ``chief`` that starts again, or a ``ps`` task
  waiting for the job's end) raises for the
  mark ``text``: the chief's own class where it is ours
  (``SyncTimeoutError`` is stock's ``DeadlineExceededError`` too) or a
  TensorFlow one, else a RuntimeError; its message says the chief stopped
  the job, and why."""
  try:
    mark = json.loads(text)
    name, reason = str(mark["type"]), str(mark["message"])
  except (ValueError, KeyError, TypeError):
    name, reason = "?", text
  message = ("the chief stopped the job: %s: %s. %s (docs/operations.md, "
             "\"A job that failed\")" % (
                 name, reason.rstrip("."),
                 _ON_PS if ps else _ON_CHIEF if chief else _ON_WORKER))
  if name == "SyncTimeoutError":
    return errors.SyncTimeoutError(message)
  if name == "SyncStallError":
    return errors.SyncStallError(message)
  # TensorFlow's own error classes, by name (no public map from codes).
  cls = getattr(tf.errors, name, None)
  if isinstance(cls, type) and issubclass(cls, tf.errors.OpError):
    return cls(None, None, message)
  return RuntimeError(message)


class AbortMark:
  """The mark's table and ops; ``build`` makes them (in our scope, on the
  global step's device).

  Args:
    shared_prefix: What the optimizer's shared names start with.
  """

  def __init__(self, *, shared_prefix):
    self.shared_name = shared_prefix + "sync_replicas_abort"
    self._text = self._write = self._read = None

  def build(self, *, device, scope):
    with tf.compat.v1.device(device), tf.compat.v1.name_scope(scope):
      # A table, as the done record: no Saver or readiness check sees it.
      table = tf.raw_ops.MutableHashTableV2(
          shared_name=self.shared_name, use_node_name_sharing=False,
          key_dtype=tf.int64, value_dtype=tf.string, name="abort_mark")
      key = tf.constant([_KEY], tf.int64)
      self._text = tf.compat.v1.placeholder(tf.string, [], name="abort_text")
      self._write = tf.raw_ops.LookupTableInsertV2(
          table_handle=table, keys=key, values=tf.reshape(self._text, [1]),
          name="write_abort")
      self._read = tf.raw_ops.LookupTableFindV2(
          table_handle=table, keys=key, default_value=tf.constant(""),
          name="read_abort")

  def write(self, session, error):
    """The chief's mark of ``error``, before it closes the token queue;
    False (logged) if the ps did not take it."""
    try:
      session.run(self._write, feed_dict={self._text: encode(error)},
                  options=_options())
    except tf.errors.OpError as e:
      _LOG.warning("sync_replicas: the chief could not leave its abort mark "
                   "on the ps (%s): workers that meet the closed token queue "
                   "may end as if training were done", type(e).__name__)
      return False
    return True

  def read(self, session, *, chief=False, ps=False):
    """The error the mark names (``decode``'s), or None: no mark, or the
    ps unreadable (the task then goes on as before)."""
    try:
      text = session.run(self._read, options=_options())[0]
    except tf.errors.OpError as e:
      _LOG.debug("reading the abort mark failed: %s", e)
      return None
    if not text:
      return None
    return decode(text.decode("utf-8", "replace"), chief=chief, ps=ps)


def _options():
  return tf.compat.v1.RunOptions(timeout_in_ms=RUN_TIMEOUT_MS)

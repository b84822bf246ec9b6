"""Exceptions raised by sync_replicas beyond the builtin ones stock uses."""

import re

import tensorflow as tf


class NotBuiltError(ValueError, AttributeError):
  """An accessor was used before ``apply_gradients`` built the sync ops.

  It is a ``ValueError`` because stock raises ``ValueError`` from
  ``get_chief_queue_runner``/``get_init_tokens_op``/the hook in that case,
  and an ``AttributeError`` because stock's ``chief_init_op`` and friends do
  not exist before ``apply_gradients`` (so ``hasattr`` keeps answering False).
  """


class SyncStallError(RuntimeError):
  """No update landed within ``stall_timeout_secs``.

  Raised through the chief's coordinator (so from the chief's
  MonitoredSession) when fewer than ``replicas_to_aggregate`` fresh gradients
  arrive in time; the message says which accumulators wait and how many
  tokens are queued.
  """


class SyncTimeoutError(tf.errors.DeadlineExceededError, SyncStallError):
  """An update cannot come before the sessions' operation timeout.

  Not in stock, which ends every run that waits for the update with a bare
  ``DeadlineExceededError: Operation timed out`` at
  ``operation_timeout_in_ms``. The chief raises this one a little before
  that, when the update lacks a gradient that a worker it names cannot push
  (its task is down, unreachable, or silent): the message says which worker,
  its address and why. It is a ``tf.errors.DeadlineExceededError``, so code
  that catches stock's error catches it, and a ``SyncStallError``.
  """

  def __init__(self, message: str) -> None:
    super().__init__(None, None, message)


#: What MonitoredSession recreates its session for (its
#: ``_PREEMPTION_ERRORS``): a task restarted or could not be reached.
PREEMPTION_ERRORS = (tf.errors.AbortedError, tf.errors.UnavailableError)

# A root error of a multi-partition step, as TensorFlow lists them in one
# message: one per line, the code first ("ABORTED: From /job:ps/...";
# 2.15 numbers them "(1) ABORTED: ...").
_ROOT_PREEMPTION = re.compile(
    r"(?:^|\n)\s*(?:\(\d+\)\s*)?(?:ABORTED|UNAVAILABLE|Aborted|Unavailable):")


def is_recoverable_error(error: BaseException) -> bool:
  """Whether ``error`` means a task restarted, so a new session recovers.

  True for what MonitoredSession already recovers from (``AbortedError``,
  ``UnavailableError``), and for a ``CancelledError`` that carries such a
  root error from another task. TensorFlow raises the latter when a
  restarted ps aborts a step while another of the step's partitions is
  waiting on a transfer: the master cancels that partition, reports both
  root errors in one message and gives it the cancelled one's code. The
  soak saw it once in CI ("CANCELLED: ... RecvFromRemoteAsync is cancelled"
  then "ABORTED: From /job:ps/replica:0/task:1: Session handle is not
  found"); tensorflow/tensorflow#35697 reports the same from a PS job.
  MonitoredSession does not recover from it and ends the process.

  A step cancelled for its own reasons (a session closed at the end of
  training, a queue closed) carries no such root error and stays False.
  """
  if isinstance(error, PREEMPTION_ERRORS):
    return True
  if not isinstance(error, tf.errors.CancelledError):
    return False
  return bool(_ROOT_PREEMPTION.search(error.message or ""))

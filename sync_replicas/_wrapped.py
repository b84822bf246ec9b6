"""What every sync optimizer shares: delegation, replica counts, guards.

Owns ``compute_gradients``, ``get_slot``, ``get_slot_names`` and
``variables``: both the accumulator-based and the legacy queue-based
optimizer answer them with the wrapped optimizer's (held in ``_opt``, the
attribute name stock uses and TensorFlow's own tests read). Also owns what
both keep alike: the replica counts and tokens per step, and the guards that
raise ``NotBuiltError`` before ``apply_gradients``, with the
stock docstrings of the methods they guard.
"""

import typing

import tensorflow as tf

from sync_replicas import _tokens
from sync_replicas import errors


class WrappedOptimizer(tf.compat.v1.train.Optimizer):
  """A ``tf.compat.v1.train.Optimizer`` that forwards to ``self._opt``.

  Subclasses define ``is_built`` and ``_build_init_tokens_op``, call
  ``_set_replica_counts`` in their constructor and name themselves in
  ``_BUILT_NAME`` for the guards' errors.
  """

  _BUILT_NAME = "SyncReplicasOptimizer"

  def _set_replica_counts(self, replicas_to_aggregate, total_num_replicas):
    self._replicas_to_aggregate = replicas_to_aggregate
    self._total_num_replicas = total_num_replicas
    self._tokens_per_step = _tokens.tokens_per_step(replicas_to_aggregate,
                                                    total_num_replicas)

  @property
  def replicas_to_aggregate(self) -> int:
    """Gradients each update aggregates."""
    return self._replicas_to_aggregate

  @property
  def total_num_replicas(self) -> int:
    """Workers in the job."""
    return self._total_num_replicas

  @property
  def tokens_per_step(self) -> int:
    """Tokens the chief enqueues after each update."""
    return self._tokens_per_step

  def _built(self, what, value=None):
    """``value``, or ``NotBuiltError`` naming ``what`` before the build."""
    if not self.is_built:
      raise errors.NotBuiltError(
          "%s.%s is only available after apply_gradients() (or minimize()) "
          "has been called on this optimizer." % (self._BUILT_NAME, what))
    return value

  def _require_built(self, message):
    """Raises ``NotBuiltError(message)`` (stock's words) before the build."""
    if not self.is_built:
      raise errors.NotBuiltError(message)

  def get_chief_queue_runner(self) -> "tf.compat.v1.train.QueueRunner":
    """Returns the QueueRunner for the chief to execute.

    It aggregates gradients, applies them, increments the global step and
    releases the next tokens, in a loop.

    Raises:
      ValueError: If this is called before apply_gradients().
    """
    self._require_built(
        "Should be called after apply_gradients(). Build the train op with "
        "minimize() or apply_gradients() first.")
    return self._chief_queue_runner

  def get_init_tokens_op(self, num_tokens: int = -1) -> tf.Operation:
    """Returns the op to fill the sync_token_queue with the tokens.

    Run once by the chief at start so that workers can start their first
    step. Make sure ``num_tokens >= replicas_to_aggregate -
    total_num_replicas``.

    Args:
      num_tokens: Number of tokens to add to the queue; -1 adds
        ``replicas_to_aggregate``.

    Returns:
      An op for the chief/sync replica to fill the token queue.

    Raises:
      ValueError: If this is called before apply_gradients().
      ValueError: If num_tokens are smaller than replicas_to_aggregate -
        total_num_replicas.
    """
    self._require_built(
        "get_init_tokens_op() should be called after apply_gradients().")
    return self._build_init_tokens_op(num_tokens)

  def _build_init_tokens_op(self, num_tokens):
    """The op that enqueues the initial tokens, after the build."""
    raise NotImplementedError(
        "%s must define _build_init_tokens_op(num_tokens), the op behind "
        "get_init_tokens_op()." % type(self).__name__)

  def compute_gradients(
      self, *args: typing.Any, **kwargs: typing.Any
  ) -> "list[tuple[typing.Any, tf.Variable]]":
    """Compute gradients of "loss" for the variables in "var_list".

    This simply wraps ``compute_gradients()`` of the wrapped optimizer, so
    per-replica gradient processing (clipping, ...) happens before the
    gradients are aggregated in ``apply_gradients()``.

    Args:
      *args: Arguments for compute_gradients().
      **kwargs: Keyword arguments for compute_gradients().

    Returns:
      A list of (gradient, variable) pairs.
    """
    return self._opt.compute_gradients(*args, **kwargs)

  def get_slot(self, *args: typing.Any,
               **kwargs: typing.Any) -> "tf.Variable | None":
    """Return a slot named "name" created for "var" by the wrapped optimizer."""
    return self._opt.get_slot(*args, **kwargs)

  def get_slot_names(self, *args: typing.Any,
                     **kwargs: typing.Any) -> "list[str]":
    """Return the names of the slots created by the wrapped optimizer."""
    return self._opt.get_slot_names(*args, **kwargs)

  def variables(self) -> "list[tf.Variable]":
    """The wrapped optimizer's variables (not the sync optimizer's own)."""
    return self._opt.variables()

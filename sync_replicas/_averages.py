"""The chief's ``variable_averages`` update, before or after the tokens.

Owns where the ``ExponentialMovingAverage`` update sits in the chief's sync
op: stock applies it after releasing the tokens; ``averages_before_tokens``
applies it before, so a worker that got its token reads averages that
include the update. Without ``variable_averages`` both steps build nothing.
"""

import tensorflow as tf


class Averages:
  """Where the chief's averages go; both methods return the op to follow.

  Args:
    variable_averages: The ``ExponentialMovingAverage``, or None.
    variables_to_average: The variables it averages.
    before_tokens: Apply it before the tokens go out (not stock's order).
  """

  def __init__(self, variable_averages, variables_to_average, *,
               before_tokens):
    self._averages = variable_averages
    self._variables = variables_to_average
    self._before = variable_averages is not None and before_tokens
    self._after = variable_averages is not None and not before_tokens

  def before_tokens(self, update_op):
    """``update_op``, or the averages' update after it."""
    return self._apply(update_op) if self._before else update_op

  def after_tokens(self, sync_op):
    """``sync_op`` (tokens released), or the averages' update after it."""
    return self._apply(sync_op) if self._after else sync_op

  def _apply(self, op):
    with tf.control_dependencies([op]), tf.compat.v1.name_scope(""):
      return self._averages.apply(self._variables)

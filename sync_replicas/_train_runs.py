"""Which runs of a worker's session train: their fetches reach the train op.

Owns the one test a session hook makes before it adds fetches of ours that
must run only with the train op (the timeline's marks, the data end's
local-step record): fetched in any other run (an evaluation, a read of the
global step) they would run a push and take a token.
"""

import tensorflow as tf

#: How far back from a fetched op ``TrainRuns.runs_train_op`` looks for the
#: train op.
REACH = 4


class TrainRuns:
  """Answers ``runs_train_op(fetches)`` for one train op, with a cache."""

  def __init__(self, train_op):
    self._train_op = getattr(train_op, "op", train_op)
    self._verdicts = {}

  def runs_train_op(self, fetches):
    """Whether a run of ``fetches`` runs the train op.

    True when a fetched element is the train op or reaches it within
    ``REACH`` steps back through inputs and control inputs: tf-slim's
    train op is the loss behind a control dependency on ours, an Estimator's
    or a script's may be a ``tf.group`` of it. Each fetched op's answer is
    kept: the graph is final while a session runs.
    """
    for element in tf.nest.flatten(fetches):
      op = getattr(element, "op", element)
      if not isinstance(op, tf.Operation):
        continue
      verdict = self._verdicts.get(op)
      if verdict is None:
        verdict = self._verdicts[op] = _reaches(op, self._train_op)
      if verdict:
        return True
    return False


def _reaches(op, target):
  """Whether ``target`` is ``op`` or among its inputs, ``REACH`` deep."""
  frontier, seen = [op], {op}
  for _ in range(REACH + 1):
    if target in frontier:
      return True
    following = []
    for node in frontier:
      for before in list(node.control_inputs) + [t.op for t in node.inputs]:
        if before not in seen:
          seen.add(before)
          following.append(before)
    frontier = following
  return False

"""Read-only status ops: what the chief waits for, and whether a take can block.

Owns the small ops, built beside the sync ops in their own name scope
(``<name>_status``), that report each accumulator's count of fresh gradients
and the token queue's length. They never take, dequeue or change anything, so
any session (the chief's, a watchdog's, a status tool's) may run them at any
time.
"""

import collections

import tensorflow as tf

# num_accumulated: one int32 scalar per accumulator, in accumulator order;
# names: the matching variable names; tokens: the token queue's size;
# ready: True when every accumulator holds enough gradients for its take, so
# running the chief's sync op cannot block; starts: how many times
# chief_init_op ran on this ps (the restart generations' queue length).
StatusOps = collections.namedtuple(
    "StatusOps", ["names", "num_accumulated", "tokens", "ready", "starts"])


def build(accumulators, token_queues, *, replicas_to_aggregate, token_device,
          scope, starts):
  """Builds the status ops.

  Args:
    accumulators: ``_accumulators.AccumulatorOps`` entries.
    token_queues: ``sync_token_q`` and, with ``one_gradient_per_worker``,
      the workers' own queues: ``tokens`` is their total size.
    replicas_to_aggregate: Gradients each take needs.
    token_device: The token queue's (global step's) device.
    scope: The name scope to build them in.
    starts: The chief starts' count (``_restart.Generations.starts``).

  Returns:
    A ``StatusOps``.
  """
  with tf.compat.v1.name_scope(scope):
    counts = []
    for entry in accumulators:
      with tf.compat.v1.device(entry.device):
        counts.append(entry.accumulator.num_accumulated())
    with tf.compat.v1.device(token_device):
      tokens = tf.add_n([q.size() for q in token_queues])
    ready = tf.reduce_all(
        tf.stack(counts) >= replicas_to_aggregate) if counts else tf.constant(
            True)
  return StatusOps([a.name for a in accumulators], counts, tokens,
                   ready, starts)


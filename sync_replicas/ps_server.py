"""Owns the settings of a ps task's own server: ``ps_server_config``.

A ps task runs no session of its own. Every step of every worker reaches it
as RPCs (RunGraph for its partition of the step, RecvTensor for each tensor
a worker pulls from it), which the server's gRPC threads hand to the
server's compute pool; the partition's kernels run on that pool and, for
their arithmetic, on the server's CPU device's thread pool. Both pools are
made once, when the ps's ``tf.distribute.Server`` starts, from the
``config`` it was given (its ``ServerDef.default_session_config``):
``inter_op_parallelism_threads`` sizes the compute pool,
``intra_op_parallelism_threads`` the device's pool, and
``experimental.disable_thread_spinning`` decides whether an idle thread of
either spins before it sleeps. The workers' session configs do not reach
them (TensorFlow's grpc_server_lib.cc, process_util.cc and
local_device.cc).

On the ps of a synchronous job the pools mostly wait: a step's partition
is a few small ops (a push into an accumulator, a dequeue, a read), and
between two of them an idle thread spins, looking for work, before it
sleeps: CPU taken from the workers when they share the ps's cores.
``ps_server_config`` turns the spin off and leaves the pools' sizes alone
(a ps with one compute thread would run the W workers' calls one at a
time). docs/benchmarks.md measures what it saves.
"""

import tensorflow as tf


def ps_server_config(
    config: "tf.compat.v1.ConfigProto | None" = None,
) -> "tf.compat.v1.ConfigProto":
  """The ``ConfigProto`` to start a ps task's ``tf.distribute.Server`` with.

  A copy of ``config`` (or a new ``ConfigProto``) whose idle threads sleep
  instead of spinning (``experimental.disable_thread_spinning``)::

      server = tf.distribute.Server(cluster, job_name="ps", task_index=i,
                                    config=sync_replicas.ps_server_config())

  Only for the ps's server: a worker's server also runs its replica's
  model, whose next op a spinning thread picks up sooner. Without it the
  ps runs with TensorFlow's defaults, as under stock. The examples' ps
  tasks (and so every program of examples/ under ``sync-replicas-launch``
  or ``sync-replicas-slurm``) start with it.

  Args:
    config: A ``tf.compat.v1.ConfigProto`` to start from (e.g. one with
      ``operation_timeout_in_ms``); not modified.

  Returns:
    A new ``tf.compat.v1.ConfigProto``.

  Raises:
    TypeError: ``config`` is not a ``tf.compat.v1.ConfigProto``.
  """
  if config is not None and not isinstance(config, tf.compat.v1.ConfigProto):
    raise TypeError(
        "ps_server_config: config must be a tf.compat.v1.ConfigProto (or "
        "None for a new one), got %s %r; pass the ConfigProto itself, not "
        "its text or a dict" % (type(config).__name__, config))
  out = tf.compat.v1.ConfigProto()
  if config is not None:
    out.CopyFrom(config)
  out.experimental.disable_thread_spinning = True
  return out

"""Restart generations: keep the steps of successive chief lifetimes apart.

Stock's staleness check compares a gradient's local step with the
accumulator's global step, and both are plain global-step values. When a
chief restarts from a checkpoint, the global step goes back to the
checkpoint's value while workers still hold tokens (local steps) from the
lost updates, and accumulators still hold gradients pushed before the crash:
both pass the check and would be applied, computed on variables that no
longer exist. (``set_global_step`` does not clear an accumulator.)

Here every chief start (each run of ``chief_init_op``) adds one element to a
small queue on the global step's device that lives as long as the ps task and
is never checkpointed; its length minus one is the restart *generation*. With
an int64 global step, tokens and accumulator steps carry ``step + generation
* 2**32``, so a local step from an earlier generation is always older than
the accumulator's and its gradients are dropped, while a replica that
(re)starts gets the current generation's global step as its local step, so
its first gradient counts, as with stock. On the first start the
generation is 0 and every value is stock's. On every start but the job's
first (``may_hold_leftovers``) the chief's init op also empties every
accumulator of what an earlier chief left behind and, from the second start
on (``restarted``), the token queues; the token policy builds those drains.

What it relies on: ``chief_init_op`` (the hook's and the TF 0.12 Supervisor
recipe's chief local init). Scripts that never run it (a Supervisor with its
default local init op, a plain Session with the initializers run by hand)
leave the queue empty; an empty queue is generation 0 too, so every value is
stock's and restarts behave as stock's (nothing cleared, no generation).
The token drain only runs from the second start on, so a script that runs
the init-tokens op before ``chief_init_op`` keeps its tokens, as with stock.

int32 global steps have no room for the generation: they keep stock's values
(the leftovers are still cleared).
"""

import collections

import tensorflow as tf

from sync_replicas import _tokens

#: Steps one generation may take before it would reach the next one.
GENERATION_STRIDE = 1 << 32

# What chief_init_op's run reads once this chief start's ``start_op`` ran,
# built once (``Generations.chief_start``) and shared by every op of that
# run that needs it. step: the global step, generation-encoded with int64
# steps (what the chief's local step and every accumulator's step are set
# to, and what the clearing switches on); encoded: whether ``step`` carries
# the generation (False for int32 steps, whose set-steps keep stock's own
# reads); restarted: the generation moved past 0 (drain the token queues);
# may_hold_leftovers: clear the accumulators (see
# ``Generations.chief_start``).
ChiefStart = collections.namedtuple(
    "ChiefStart", ["step", "encoded", "restarted", "may_hold_leftovers"])


class Generations:
  """The generation queue and the values read from it.

  Build under the global step's device, in our own name scope. Every value
  is built once per graph, where it is computed, and handed to its users:

  * ``starts`` and ``encode``'s offset, read with no ordering, in every run
    that does not start the chief (the train op with statistics, the sync
    op, the init tokens, local step inits, the status reads): the
    generation only moves in ``chief_init_op``'s run, so in any other run
    one read of it is as good as another;
  * ``chief_start``'s values, read after this start's ``start_op``, in
    ``chief_init_op``'s run only.
  """

  def __init__(self, global_step, *, scope,
               token_queue_shared_name=_tokens.TOKEN_QUEUE_NAME):
    self._scope = scope
    self._device = global_step.device
    self.enabled = global_step.dtype.base_dtype == tf.int64
    #: Where a status reader finds the queue on the ps.
    self.shared_name = token_queue_shared_name + "_generations"
    with tf.compat.v1.device(self._device), tf.compat.v1.name_scope(scope):
      self._queue = tf.queue.FIFOQueue(
          -1, tf.int32, shapes=(), name="generations",
          shared_name=self.shared_name)
      self.start_op = self._queue.enqueue(1, name="start_generation")
      # Read by the stall report (0 means chief_init_op never ran here) and,
      # in the runs that do not start the chief, the generation's source.
      self.starts = self._queue.size(name="starts")
      # No control dependency: a train-op or sync-op run computes it, and
      # must never wait for (or run) a start.
      self._offset = (_offset(_generation(self.starts)) if self.enabled
                      else None)

  def encode(self, steps):
    """``steps`` plus this generation's offset (unchanged for int32 steps).

    One op per call, on the shared offset (read with no ordering: use it
    outside ``chief_init_op``'s run, or where reading the generation before
    this start's ``start_op`` is fine, see ``local_step_value``).
    """
    if not self.enabled:
      return steps
    with tf.compat.v1.device(self._device), \
        tf.compat.v1.name_scope(self._scope):
      return tf.add(steps, self._offset, name="with_generation")

  def local_step_value(self, global_step):
    """A (re)started replica's local step: the global step, in this generation.

    Stock sets a starting worker's local step to the global step, so its
    first gradient is fresh. Plain, it would be one generation behind the
    accumulators' steps after a chief restart, and every replica that
    starts then would waste its first push and need a token to catch up:
    the soak stalled for good when a worker died holding such a token and
    the restarted chief's own first push was stale too (issue 20).
    Generation 0 (and int32 steps): the plain global step, as stock.
    In ``chief_init_op`` this may read the generation before this start's
    ``start_op``; ``chief_local_step_ops`` sets it again, after it.
    """
    return self.encode(global_step)

  def chief_start(self, global_step):
    """What ``chief_init_op``'s run needs once this start's ``start_op`` ran.

    Built once, under that dependency, and shared by every op of the run
    that reads it (the chief's local step, the accumulators' clearing and
    set-steps, the token drains). Never use it in another run: computing
    it runs ``start_op``, a chief start.

    ``may_hold_leftovers`` is false only on the job's first start: the
    first chief start the ps has seen (generation 0) and a global step
    still 0. Then nothing earlier can have pushed, and what the
    accumulators hold was pushed by this job's replicas before
    ``chief_init_op`` ran: stock keeps it, and so do we. On any other start
    (a restarted chief, a job restored from a checkpoint) leftovers cannot
    be told apart from such early pushes, and the accumulators are cleared.

    ``restarted`` says whether to drain the token queues: on a restart,
    what they hold carries an earlier generation's steps. On the first
    start nothing earlier exists, and a queue may already hold the init
    tokens (a script that runs the init-tokens op before
    ``chief_init_op``, valid with stock): those stay.

    Returns:
      A ``ChiefStart``.
    """
    with tf.compat.v1.device(self._device), \
        tf.compat.v1.name_scope(self._scope), \
        tf.control_dependencies([self.start_op]):
      generation = _generation(self._queue.size(name="starts_after_start"))
      restarted = tf.greater(generation, 0, name="restarted")
      step = tf.convert_to_tensor(global_step)
      may_hold_leftovers = tf.logical_or(
          restarted, tf.not_equal(step, 0), name="may_hold_leftovers")
      if self.enabled:
        step = tf.add(step, _offset(generation), name="step_after_start")
    return ChiefStart(step, self.enabled, restarted, may_hold_leftovers)

  def chief_local_step_ops(self, local_step, start, *, after):
    """The chief's local step once its start moved the generation: one op,
    or none for int32 steps (no generation).

    ``local_step_init_op`` (part of ``chief_init_op``) may read the
    generation before this start's ``start_op`` ran; this sets it again to
    ``start.step`` (a ``ChiefStart``), after the ops of ``after`` (that
    assign), so the chief's first push is fresh too.
    """
    if not self.enabled:
      return []
    with tf.compat.v1.name_scope(self._scope), \
        tf.control_dependencies(after):
      # No read of the value assigned: nothing uses one.
      return [local_step.assign(start.step, read_value=False,
                                name="chief_local_step")]


def _generation(starts):
  """Starts minus one, and 0 when ``chief_init_op`` never ran (no start).

  Without the floor, a script that never runs ``chief_init_op`` would read
  generation -1 and shift every token 2**32 below the accumulators' steps:
  every push stale, training stalled after the first update (issue 16).
  ``generation_of`` is the same rule on a value read from the queue (the
  stall diagnosis, tools): change one, change both.
  """
  return tf.maximum(starts - 1, 0, name="generation")


def generation_of(starts):
  """``_generation`` on a Python int: the generation of ``starts`` starts.

  ``starts`` None (the queue could not be read) counts as no start.
  """
  return max((starts or 0) - 1, 0)


def decode(step, encoded):
  """``(generation, plain step)`` of a step; ``encoded``: it carries one.

  The inverse of the offset ``Generations.encode`` adds to int64 steps;
  int32 steps (``encoded`` False) carry no generation.
  """
  if not encoded:
    return 0, step
  return step // GENERATION_STRIDE, step % GENERATION_STRIDE


def _offset(generation):
  """The int64 step offset of ``generation``."""
  return tf.cast(generation, tf.int64) * GENERATION_STRIDE

"""The SyncReplicasOptimizer APIs of TensorFlow 0.8 to 0.12.

Owns two names from the 0.x documentation:

* ``SyncReplicasOptimizerV2``: TensorFlow 0.12's name for today's class. It is
  ``sync_replicas.SyncReplicasOptimizer`` itself (accumulators, averaging,
  ``chief_init_op``/``local_step_init_op``/``ready_for_local_init_op``), kept
  so that 0.12 code and its Supervisor recipe run unchanged.
* ``SyncReplicasOptimizer``: the original queue-based optimizer of 0.8 to 0.11
  (deprecated in 0.12), rebuilt here on ``tf.compat.v1`` with its
  constructor, its ``replica_id``, its summing and its graph shape.

The queue-based protocol:

* A ``local_steps`` vector on the global step's device holds every replica's
  local step, indexed by ``replica_id``.
* Each worker compares ``local_steps[replica_id]`` with the global step. If it
  is behind, its gradients are dropped; otherwise every dense gradient goes
  into that variable's FIFOQueue, and every sparse one into a values/indices
  queue followed by one token in that variable's sparse token queue.
* The chief's queue runner dequeues ``replicas_to_aggregate`` gradients per
  dense variable and SUMS them; for a sparse variable it waits for
  ``replicas_to_aggregate`` tokens, then takes every row queued so far and
  sums rows that share an index. It applies the sums with the wrapped
  optimizer (which increments the global step), empties every queue of
  leftover gradients, and only then enqueues ``max(total_num_replicas,
  replicas_to_aggregate)`` tokens carrying the new global step.
* A worker's train op waits for one token after its pushes and stores it in
  ``local_steps[replica_id]``: that is the barrier.

Known race (stock's, reproduced, not fixed): the staleness check and the
push are separate steps, and the chief's update can run between them. A
replica (typically a backup) that reads ``local_steps[replica_id] ==
global_step`` just before the chief applies an update, increments the global
step and empties the queues, pushes its gradient after the emptying: the
gradient, computed from the old weights, sits in the queue and is summed into
the NEXT update as if it were fresh.

A related stock quirk, also reproduced: for a sparse variable the chief takes
every row queued by the time the ``replicas_to_aggregate``-th token arrives,
so rows from a backup that land in time are summed in too, and that update
holds more than ``replicas_to_aggregate`` gradients (dense ones never do).

Why the accumulator design (``SyncReplicasOptimizerV2``, today's class)
replaced it: a ``ConditionalAccumulator`` checks a gradient's local step
against its own global step inside the apply op, under the accumulator's
lock, and ``take_grad`` moves that global step in the same critical section.
A gradient therefore either counts in the update it was computed for or is
dropped; there is no window and no emptying pass. The local step becomes a
worker-local variable, so ``replica_id`` and the shared ``local_steps``
vector disappear, and averaging instead of summing keeps the learning rate
independent of ``replicas_to_aggregate``.

One deliberate difference from the 0.11 graph: stock picked "push" or "skip"
with ``tf.cond``. Under TensorFlow 2 control flow a cond becomes a function
call, which would wrap the ps-side enqueues in a function run across tasks.
Here each enqueue is an ``enqueue_many`` of one item (all rows, for sparse) or
of none, chosen by the same staleness check; an empty enqueue returns at once
even on a full queue, so the effect is stock's.
"""

import logging
import numbers

import tensorflow as tf

from sync_replicas import _checks
from sync_replicas import _compat
from sync_replicas import _tokens
from sync_replicas import _wrapped
from sync_replicas import optimizer as optimizer_lib

_LOG = logging.getLogger(__name__)

#: TensorFlow 0.12's name for the accumulator-based optimizer; the same class.
SyncReplicasOptimizerV2 = optimizer_lib.SyncReplicasOptimizer

#: The message the clean-up op aborts its task with, as in stock.
ABORT_MESSAGE = "From sync_replicas"
#: Stock's shared names for the token queue and for the queue its chief
#: QueueRunner is attached to.
TOKEN_QUEUE_NAME = _tokens.TOKEN_QUEUE_NAME
DUMMY_QUEUE_NAME = "dummy_queue"

# One package, one wording of the shared argument checks.
_check_positive_int = _checks.positive_int
_check_opt = _checks.v1_optimizer


def _check_total_num_replicas(total_num_replicas, replicas_to_aggregate):
  if (isinstance(total_num_replicas, bool)
      or not isinstance(total_num_replicas, numbers.Integral)
      or total_num_replicas < 0):
    raise ValueError(
        "total_num_replicas must be a non-negative int, got %r (%s). Pass the "
        "number of worker tasks, or 0 to use replicas_to_aggregate (%d)."
        % (total_num_replicas, type(total_num_replicas).__name__,
           replicas_to_aggregate))
  return int(total_num_replicas) or replicas_to_aggregate


def _check_replica_id(replica_id, total_num_replicas):
  # Checked here, not when the slice op runs: an out-of-range id would only
  # fail inside the first train step, and a None one deep in graph building.
  if replica_id is None:
    raise ValueError(
        "replica_id is required: it indexes this worker's entry of the "
        "local_steps vector. Pass the worker's task index, an int in "
        "[0, total_num_replicas) = [0, %d)." % total_num_replicas)
  if (isinstance(replica_id, bool) or not isinstance(replica_id,
                                                     numbers.Integral)):
    raise ValueError(
        "replica_id must be an int in [0, total_num_replicas) = [0, %d), got "
        "%r (%s). Pass the worker's task index." %
        (total_num_replicas, replica_id, type(replica_id).__name__))
  if not 0 <= replica_id < total_num_replicas:
    raise ValueError(
        "replica_id must be in [0, total_num_replicas) = [0, %d), got %d. "
        "Pass the worker's task index, and total_num_replicas equal to the "
        "number of worker tasks (backups included)."
        % (total_num_replicas, replica_id))
  return int(replica_id)


def _fill_tokens(token_queue, global_step, count):
  """Enqueues ``count`` copies of the global step, read when the op runs.

  The read honours the control dependencies in effect. Stock needed
  ``global_step.ref()`` for that: a plain conversion of a reference variable
  returns a snapshot taken earlier in the step, before the update incremented
  it.
  """
  if hasattr(global_step, "read_value"):
    step = global_step.read_value()
  else:
    step = tf.identity(global_step)
  return token_queue.enqueue_many((tf.fill([count], step),))


def _check_arguments(opt, replicas_to_aggregate, total_num_replicas,
                     replica_id, variable_averages, variables_to_average):
  """The constructor's checks; returns the replica counts and the id."""
  replicas_to_aggregate = _check_positive_int(
      "replicas_to_aggregate", replicas_to_aggregate,
      "Pass how many gradients each update sums, e.g. the number of "
      "workers.")
  total_num_replicas = _check_total_num_replicas(total_num_replicas,
                                                 replicas_to_aggregate)
  replica_id = _check_replica_id(replica_id, total_num_replicas)
  _check_opt(opt)
  _checks.averages(variable_averages, variables_to_average)
  return replicas_to_aggregate, total_num_replicas, replica_id


def _check_queue_shapes(grads_and_vars):
  """Raises unless every gradient's (row) shape fits a queue element."""
  for grad, var in grads_and_vars:
    if grad is None:
      continue
    name = getattr(var, "name", var)
    shape = var.get_shape()
    if _compat.is_sparse_gradient(grad):
      if shape.ndims in (None, 0):
        raise ValueError(
            "A sparse gradient needs a variable of rank >= 1 (its rows are "
            "queued), got %s of shape %s. Pass a dense gradient for it "
            "instead (tf.convert_to_tensor(grad))." % (name, shape))
      shape = shape[1:]
    # Queue elements have fixed shapes, so dequeue_many can batch them.
    if not shape.is_fully_defined():
      raise ValueError(
          "Variable %s has shape %s; the gradient queues need a fully "
          "defined (row) shape, got %s. Create the variable with a static "
          "shape." % (name, var.get_shape(), shape))


def _queue_sparse_grad(grad, var, pushes, num_fresh, *, replicas_to_aggregate,
                       one_element_queues, sparse_queues):
  """Queues one replica's rows; returns the chief's summed rows.

  Sparse gradients are queued as (value row, index) pairs rather than whole
  IndexedSlices, as their row counts differ from push to push.

  Args:
    grad: The ``tf.IndexedSlices`` gradient of ``var``.
    var: The variable it belongs to.
    pushes: The worker's push ops; the token enqueue is appended.
    num_fresh: 1 if this replica's gradients are fresh, 0 if stale.
    replicas_to_aggregate: Pushes each update sums.
    one_element_queues: ``(queue, device)`` list; gets the token queue.
    sparse_queues: ``(queue, device)`` list; gets the rows' queue.

  Returns:
    The aggregated ``tf.IndexedSlices``: unique indices, summed rows.
  """
  sparse_grad_queue = tf.queue.FIFOQueue(
      -1, (grad.values.dtype, grad.indices.dtype),
      shapes=(var.get_shape()[1:], ()),
      shared_name="sparse_grad_q_%s" % var.name)
  sparse_queues.append((sparse_grad_queue, var.device))

  # The token goes in only after the rows did, so the chief, once it has
  # replicas_to_aggregate tokens, knows that many pushes are complete.
  sparse_token_queue = tf.queue.FIFOQueue(
      replicas_to_aggregate * 2, tf.int32, shapes=(),
      shared_name="sparse_token_q_%s" % var.name)
  one_element_queues.append((sparse_token_queue, var.device))

  rows = num_fresh * tf.shape(grad.indices)[0]  # All rows, or none.
  enqueue_sparse_op = sparse_grad_queue.enqueue_many(
      [grad.values[:rows], grad.indices[:rows]])
  with tf.control_dependencies([enqueue_sparse_op]):
    pushes.append(sparse_token_queue.enqueue_many(
        [tf.ones([num_fresh], tf.int32)]))

  with tf.control_dependencies(
      [sparse_token_queue.dequeue_many(replicas_to_aggregate)]):
    # Every row queued by now: the tokens' pushes and any later ones.
    values, indices = sparse_grad_queue.dequeue_many(
        sparse_grad_queue.size())
    # One row per index, so that the wrapped optimizer updates each row
    # once: apply(g1 + g2) differs from apply(g1); apply(g2) for Momentum,
    # Adagrad and the like.
    new_indices, position = tf.unique(indices)
    num_indices = tf.shape(new_indices)[0]
    sum_values = tf.math.unsorted_segment_sum(values, position, num_indices)
    return tf.IndexedSlices(sum_values, new_indices, grad.dense_shape)


def _token_queues(global_step):
  """``sync_token_q`` and the chief QueueRunner's placeholder queue."""
  with tf.compat.v1.device(global_step.device), \
      tf.compat.v1.name_scope(""):
    sync_token_queue = tf.queue.FIFOQueue(
        -1, global_step.dtype.base_dtype, shapes=(), name=TOKEN_QUEUE_NAME,
        shared_name=TOKEN_QUEUE_NAME)
    # Stock 0.11 gave its QueueRunner this placeholder rather than a
    # real queue: a QueueRunner closes its queue when the coordinator
    # stops, and a closed queue on a ps stays closed for the next session.
    dummy_queue = tf.queue.FIFOQueue(1, tf.int32, shapes=(),
                                     name=DUMMY_QUEUE_NAME,
                                     shared_name=DUMMY_QUEUE_NAME)
  return sync_token_queue, dummy_queue


def _clear_queues_after(update_op, one_element_queues, sparse_queues):
  """Empties every queue once ``update_op`` ran; returns the ops."""
  # Gradients still queued after an update are stale: replicas that were
  # restarted and pushed twice, backups, sparse tokens beyond the count.
  clear_queue_ops = []
  with tf.control_dependencies([update_op]):
    for queue, dev in one_element_queues:
      with tf.compat.v1.device(dev):
        clear_queue_ops.append(queue.dequeue_many(queue.size()))
    for queue, dev in sparse_queues:
      with tf.compat.v1.device(dev):
        _, stale_indices = queue.dequeue_many(queue.size())
        clear_queue_ops.append(stale_indices)
  return clear_queue_ops


def _local_step_check(global_step, total_num_replicas, replica_id):
  """Builds ``local_steps``; returns it and 1 if this replica is fresh."""
  with tf.compat.v1.device(global_step.device):
    local_steps = tf.compat.v1.Variable(
        tf.zeros([total_num_replicas],
                 dtype=global_step.dtype.base_dtype),
        trainable=False, name="local_steps")
  local_step = tf.slice(local_steps.read_value(),
                        tf.reshape(replica_id, (1,)), [1],
                        name="get_local_step")
  local_step = tf.reshape(local_step, ())
  is_stale = tf.less(local_step, global_step)
  # Stock's tf.cond between "push" and "skip", as an item count (see the
  # module docstring): 1 pushes, 0 skips.
  return local_steps, tf.cast(tf.logical_not(is_stale), tf.int32,
                              name="num_fresh")


class SyncReplicasOptimizer(_wrapped.WrappedOptimizer):
  """The TensorFlow 0.8 to 0.11 SyncReplicasOptimizer, built on queues.

  Gradients from replicas are SUMMED, not averaged (0.12 changed that), so
  the learning rate of 0.11 recipes carries over unchanged.

  Usage (0.11's)::

    opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    opt = sync_replicas.legacy.SyncReplicasOptimizer(
        opt, replicas_to_aggregate=50, replica_id=task_index,
        total_num_replicas=50)  # 52 for 2 backup replicas
    train_op = opt.minimize(total_loss, global_step=global_step)
    init_tokens_op = opt.get_init_tokens_op()
    chief_queue_runner = opt.get_chief_queue_runner()
    init_op = tf.compat.v1.global_variables_initializer()
    sv = tf.compat.v1.train.Supervisor(is_chief=is_chief, logdir=logdir,
                                       init_op=init_op)
    sess = sv.prepare_or_wait_for_session(server.target)
    if is_chief:
      sv.start_queue_runners(sess, [chief_queue_runner])
      sess.run(init_tokens_op)
  """

  _BUILT_NAME = "legacy.SyncReplicasOptimizer"

  def __init__(self,
               opt,
               replicas_to_aggregate,
               variable_averages=None,
               variables_to_average=None,
               replica_id=None,
               total_num_replicas=0,
               use_locking=False,
               name="sync_replicas"):
    """Construct a sync_replicas optimizer.

    Args:
      opt: The actual optimizer that will be used to compute and apply the
        gradients. Must be a ``tf.compat.v1.train.Optimizer``.
      replicas_to_aggregate: Number of replicas to aggregate for each
        variable update.
      variable_averages: Optional ``ExponentialMovingAverage`` applied by the
        chief after each update to ``variables_to_average``.
      variables_to_average: The variables to average; required with, and only
        with, ``variable_averages``.
      replica_id: This is the task/worker/replica ID, the index of this
        replica's entry in ``local_steps``. Must be in
        ``[0, total_num_replicas)``.
      total_num_replicas: Total number of tasks/workers/replicas, could be
        different from replicas_to_aggregate. If greater, the difference is
        backup replicas; if smaller, replicas compute several batches per
        update. 0 (the default) means ``replicas_to_aggregate``.
      use_locking: Passed to the base Optimizer (unused, as in stock).
      name: The name scope of the queue ops.

    Raises:
      ValueError: For a non-positive ``replicas_to_aggregate``, a negative
        ``total_num_replicas``, a missing or out-of-range ``replica_id``, or
        a ``variable_averages``/``variables_to_average`` mismatch.
      TypeError: If ``opt`` is not a ``tf.compat.v1.train.Optimizer``.
    """
    replicas_to_aggregate, total_num_replicas, replica_id = _check_arguments(
        opt, replicas_to_aggregate, total_num_replicas, replica_id,
        variable_averages, variables_to_average)
    super().__init__(use_locking, name)
    _LOG.info(
        "SyncReplicas enabled: replicas_to_aggregate=%s; total_num_replicas=%s",
        replicas_to_aggregate, total_num_replicas)
    # Stock's attribute names, kept for code that reached into them.
    self._opt = opt
    self._set_replica_counts(replicas_to_aggregate, total_num_replicas)
    self._gradients_applied = False
    self._variable_averages = variable_averages
    self._variables_to_average = variables_to_average
    self._replica_id = replica_id
    self._declare_build_state()

  def _declare_build_state(self):
    """What ``apply_gradients`` builds: nothing yet."""
    self._global_step = None
    self._local_steps = None
    self._sync_token_queue = None
    # Run by the chief only: aggregate, apply, empty the queues, release.
    self._chief_queue_runner = None
    # (queue, device) of every queue holding one item per push: the dense
    # gradient queues and the sparse token queues, emptied after an update.
    self._one_element_queue_list = []
    # (queue, device) of the sparse values/indices queues, emptied likewise.
    self._sparse_grad_queues_and_devs = []
    # Aborts the token queue's task, so that every replica restarts instead
    # of hanging when the chief dies halfway through applying an update.
    self._clean_up_op = None

  # ---------------------------------------------------------------- accessors

  @property
  def is_built(self):
    """True once ``apply_gradients`` has built the synchronization ops."""
    return self._gradients_applied

  @property
  def replica_id(self):
    return self._replica_id

  @property
  def local_steps(self):
    """The shared ``local_steps`` vector, one entry per replica."""
    return self._built("local_steps", self._local_steps)

  @property
  def token_queue(self):
    """The ``sync_token_q`` queue."""
    return self._built("token_queue", self._sync_token_queue)

  @property
  def gradient_queues(self):
    """``(queue, device)`` pairs of every queue the chief empties.

    Dense gradient queues and sparse token queues first, in variable order,
    then the sparse values/indices queues.
    """
    self._built("gradient_queues", self._chief_queue_runner)
    return (list(self._one_element_queue_list)
            + list(self._sparse_grad_queues_and_devs))

  # ------------------------------------------------------------------ build

  def _validate(self, grads_and_vars, global_step):
    """Checks every argument of apply_gradients before any op exists."""
    if self._gradients_applied:
      raise RuntimeError(
          "apply_gradients() was already called on this legacy "
          "SyncReplicasOptimizer (global step %s). Each instance builds one "
          "set of queues and one local_steps vector; create one optimizer per "
          "train op." % self._global_step.name)
    _checks.apply_arguments(grads_and_vars, global_step)
    _check_queue_shapes(grads_and_vars)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Apply gradients to variables.

    Builds ``local_steps``, the gradient queues, the chief's
    sum-apply-empty-release op (run by its queue runner) and the worker's
    check-push-wait train op.

    Args:
      grads_and_vars: List of (gradient, variable) pairs as returned by
        compute_gradients().
      global_step: The int32/int64 global step variable; required, as it is
        what gradients' staleness is measured against.
      name: Accepted for API compatibility and, as in stock, unused.

    Returns:
      train_op: The op that pushes this replica's gradients (unless they are
      stale) and waits for a token, which it stores as the replica's entry of
      ``local_steps``.

    Raises:
      ValueError: If grads_and_vars is empty or holds no gradient or an
        unknown gradient type, if a variable's shape is not static, or if
        global_step is missing or not integer.
      RuntimeError: If called a second time on the same instance.
    """
    del name  # Stock ignores it too.
    grads_and_vars = tuple(grads_and_vars)
    self._validate(grads_and_vars, global_step)
    self._global_step = global_step
    self._local_steps, num_fresh = _local_step_check(
        global_step, self._total_num_replicas, self._replica_id)
    with tf.compat.v1.name_scope(None, self.get_name()):
      pushes, aggregated = self._queue_gradients(grads_and_vars, num_fresh)
      with tf.compat.v1.device(global_step.device), \
          tf.compat.v1.name_scope(""):
        update_op = self._opt.apply_gradients(
            list(zip(aggregated, [var for _, var in grads_and_vars],
                     strict=True)),
            global_step)
      sync_token_queue, dummy_queue = _token_queues(global_step)
      clear_queue_ops = _clear_queues_after(
          update_op, self._one_element_queue_list,
          self._sparse_grad_queues_and_devs)
      with tf.compat.v1.device(global_step.device):
        clean_up_op = tf.raw_ops.Abort(error_msg=ABORT_MESSAGE)
      with tf.compat.v1.device(global_step.device), \
          tf.compat.v1.name_scope(""):
        # Replicas wait for a token only after all their pushes landed.
        with tf.control_dependencies(pushes):
          token = sync_token_queue.dequeue()
          train_op = tf.compat.v1.scatter_update(self._local_steps,
                                                 self._replica_id, token)
        chief_queue_runner = self._chief_runner(
            sync_token_queue, dummy_queue, clear_queue_ops, global_step)
    self._sync_token_queue = sync_token_queue
    self._clean_up_op = clean_up_op
    self._chief_queue_runner = chief_queue_runner
    # Set last: is_built flips only once everything above exists.
    self._gradients_applied = True
    return train_op

  def _queue_gradients(self, grads_and_vars, num_fresh):
    """Every variable's queue; returns the pushes and the chief's sums."""
    pushes, aggregated = [], []
    for grad, var in grads_and_vars:
      with tf.compat.v1.device(var.device):
        if grad is None:
          aggregated.append(None)  # Passed through, as in stock.
        elif _compat.is_dense_gradient(grad):
          gradient_queue = tf.queue.FIFOQueue(
              self._tokens_per_step * 2, grad.dtype,
              shapes=[var.get_shape()], shared_name=var.name)
          self._one_element_queue_list.append((gradient_queue, var.device))
          pushes.append(gradient_queue.enqueue_many(
              [tf.expand_dims(grad, 0)[:num_fresh]]))
          gradients = gradient_queue.dequeue_many(
              self._replicas_to_aggregate)
          aggregated.append(tf.reduce_sum(gradients, [0]))
        else:
          aggregated.append(_queue_sparse_grad(
              grad, var, pushes, num_fresh,
              replicas_to_aggregate=self._replicas_to_aggregate,
              one_element_queues=self._one_element_queue_list,
              sparse_queues=self._sparse_grad_queues_and_devs))
    return pushes, aggregated

  def _chief_runner(self, sync_token_queue, dummy_queue, clear_queue_ops,
                    global_step):
    """The chief's sync op (release, then averages) and its QueueRunner."""
    # Tokens go out only after the update and the emptying, and carry
    # the global step read after both.
    with tf.control_dependencies(clear_queue_ops):
      sync_op = _fill_tokens(sync_token_queue, global_step,
                             self._tokens_per_step)
    if self._variable_averages is not None:
      with tf.control_dependencies([sync_op]), \
          tf.compat.v1.name_scope(""):
        sync_op = self._variable_averages.apply(
            self._variables_to_average)
    # Stock printed the same deprecation; ours stays quiet (_compat).
    with _compat.quiet_deprecations():
      return tf.compat.v1.train.QueueRunner(dummy_queue, [sync_op])

  # ------------------------------------------------------------ chief side

  def get_clean_up_op(self):
    """Returns the clean up op for the chief to execute before exit.

    It aborts the task holding the token queue (the global step's device),
    so that every other replica fails and restarts too. Without it a chief
    restarted halfway through an update would wait forever for gradients
    that the workers, already past that step, will never push again. It
    kills the whole process of that task: run it only when the job is lost.

    Raises:
      ValueError: If this is called before apply_gradients().
    """
    self._require_built(
        "get_clean_up_op() should be called after apply_gradients().")
    return self._clean_up_op

  def _build_init_tokens_op(self, num_tokens):
    """The op enqueueing the initial tokens (a no-op for none)."""
    num_tokens = _checks.init_tokens(
        num_tokens, replicas_to_aggregate=self._replicas_to_aggregate,
        total_num_replicas=self._total_num_replicas)
    if num_tokens > 0:
      with tf.compat.v1.device(self._global_step.device), \
          tf.compat.v1.name_scope(""):
        return _fill_tokens(self._sync_token_queue, self._global_step,
                            num_tokens)
    return tf.no_op(name="no_init_tokens")

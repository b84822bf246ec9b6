"""Per-variable gradient accumulators: the ps side of the protocol.

Owns one ``ConditionalAccumulator`` (dense gradient) or
``SparseConditionalAccumulator`` (``IndexedSlices`` gradient) per trained
variable, placed on that variable's device and shared under the stock name
``<var.name>/grad_accum``. Each accumulator drops gradients whose local step is
older than its global step, averages ``replicas_to_aggregate`` fresh ones on
``take``, and is re-synced to the global step by the chief's init op.

Sparse gradients are reduced as ``sparse_reduction`` says: ``"row_mean"``
(stock's MEAN accumulator), ``"sum"`` (a SUM accumulator) or
``"replica_mean"`` (a SUM accumulator with one extra row, index ``rows``,
that every push fills with ones: the take's extra row then holds how many
gradients it summed, which the real rows are divided by).
"""

import collections

import tensorflow as tf

from sync_replicas import _checks
from sync_replicas import _compat
from sync_replicas import _transfer

#: The sparse reduction that divides each summed row by the number of
#: aggregated gradients (``_checks.SPARSE_REDUCTIONS`` lists them all).
REPLICA_MEAN = "replica_mean"

# One accumulator's share of the protocol: ``push`` runs on every worker step,
# ``take`` yields the averaged gradient for the chief, ``accumulator`` is kept
# so the chief can set its global step. ``name`` says what it aggregates (a
# variable's op name), ``shape`` is the dense shape of what it is pushed
# (for "replica_mean" one row more than the variable: the count row).
AccumulatorOps = collections.namedtuple(
    "AccumulatorOps", ["accumulator", "device", "push", "take", "name",
                       "shared_name", "shape", "sparse"])


def combine_duplicates(grad):
  """The same gradient with unique, sorted indices (rows of an index summed).

  The sparse accumulator assumes each pushed gradient's indices are sorted
  and unique; embedding lookups produce neither, and then the accumulator
  neither merges nor averages rows (measured: a take of two pushes returned
  their rows concatenated, unscaled). Run on the worker, before the push.
  """
  unique, position = tf.unique(grad.indices)
  summed = tf.math.unsorted_segment_sum(grad.values, position,
                                        tf.shape(unique)[0])
  order = tf.argsort(unique)
  return tf.IndexedSlices(tf.gather(summed, order), tf.gather(unique, order),
                          grad.dense_shape)


def shared_name(var, prefix=""):
  """The stock shared name: every worker's graph meets in one accumulator.

  ``prefix`` (see ``_tokens.shared_prefix``) is empty for the default
  optimizer name.
  """
  return prefix + var.name + "/grad_accum"


def check_sparse_reduction(grads_and_vars, reduction):
  """Raises before any op if ``reduction`` cannot serve these gradients.

  ``"replica_mean"`` counts the aggregated gradients in an extra row at
  index ``rows`` (the variable's first dimension), so that dimension must be
  known while the graph is built.

  Args:
    grads_and_vars: The (gradient, variable) pairs of ``apply_gradients``.
    reduction: One of ``_checks.SPARSE_REDUCTIONS``.

  Raises:
    ValueError: For an unknown reduction, or for ``"replica_mean"`` with a
      sparse gradient whose variable has no static first dimension.
  """
  _checks.sparse_reduction(reduction)
  if reduction != REPLICA_MEAN:
    return
  for grad, var in grads_and_vars:
    if not _compat.is_sparse_gradient(grad):
      continue
    shape = var.get_shape()
    # A rank-0 variable has no row dimension at all; say so the same way.
    if not shape.rank or tf.compat.dimension_value(shape[0]) is None:
      raise ValueError(
          "sparse_reduction=\"replica_mean\" needs the number of rows (the "
          "first dimension) of every variable with a sparse gradient when the "
          "graph is built: it counts the aggregated gradients in one extra "
          "row after the last. Variable %s has shape %s. Create it with a "
          "static shape (e.g. tf.compat.v1.get_variable(name, [rows, dim])), "
          "or use sparse_reduction=\"row_mean\" or \"sum\", which need no "
          "row count." % (var.op.name, shape))


def build(grad, var, *, local_step, replicas_to_aggregate, prefix="",
          sparse_reduction=_checks.ROW_MEAN, arrive=lambda grad: grad,
          wire=_transfer.UNCOMPRESSED, gate=()):
  """Creates the accumulator for one (gradient, variable) pair.

  Must be called inside the variable's device scope and the optimizer's name
  scope, in the same order as stock, so that op names match stock's.

  Args:
    grad: A dense ``tf.Tensor`` or a ``tf.IndexedSlices`` (never None).
    var: The variable the gradient belongs to.
    local_step: The worker's ``sync_rep_local_step`` variable.
    replicas_to_aggregate: How many gradients each ``take`` waits for.
    prefix: The shared-name prefix (see ``shared_name``).
    sparse_reduction: For an ``IndexedSlices`` gradient, one of
      ``_checks.SPARSE_REDUCTIONS`` (checked by ``check_sparse_reduction``);
      ``"sum"`` and ``"replica_mean"`` expect sorted, unique indices
      (``combine_duplicates``).
    arrive: Applied, in the variable's device scope, to exactly what the
      push receives (the statistics order it after their pre-push read
      there: ``_stats.Statistics.order_gradient``).
    wire: The ``_transfer`` unit: what the push receives crosses encoded
      beside the gradient and is decoded here, before ``arrive``; the
      accumulator keeps ``grad``'s dtype.
    gate: Control inputs of the push (``_routes``: every gradient of the
      run computed, with a ``data_end`` policy).

  Returns:
    An ``AccumulatorOps``; ``take`` has the same kind as ``grad``.
  """
  if _compat.is_dense_gradient(grad):
    accum = tf.compat.v1.ConditionalAccumulator(
        grad.dtype, shape=var.get_shape(),
        shared_name=shared_name(var, prefix))
    with tf.control_dependencies(gate):
      push = accum.apply_grad(arrive(_cross(wire, grad, var.get_shape())),
                              local_step=local_step)
    take = accum.take_grad(replicas_to_aggregate)
  elif sparse_reduction == _checks.ROW_MEAN:
    # Sparse accumulators learn the row shape from the first gradient, which
    # is why stock passes shape=() here.
    accum = tf.compat.v1.SparseConditionalAccumulator(
        grad.dtype, shape=(), shared_name=shared_name(var, prefix))
    with tf.control_dependencies(gate):
      push = accum.apply_indexed_slices_grad(
          arrive(_cross(wire, grad, var.get_shape())), local_step=local_step)
    take = accum.take_indexed_slices_grad(replicas_to_aggregate)
  else:
    return _build_sparse_sum(
        grad, var, local_step=local_step,
        replicas_to_aggregate=replicas_to_aggregate, prefix=prefix,
        count_rows=sparse_reduction == REPLICA_MEAN, arrive=arrive,
        wire=wire, gate=gate)
  return AccumulatorOps(accum, var.device, push, take, var.op.name,
                        shared_name(var, prefix), var.shape,
                        not _compat.is_dense_gradient(grad))


def _cross(wire, grad, shape):
  """``grad`` as the push receives it: encoded beside it, decoded here."""
  return wire.receive(wire.send(grad), grad, shape)


def _build_sparse_sum(grad, var, *, local_step, replicas_to_aggregate, prefix,
                      count_rows, arrive, wire, gate):
  """A SUM accumulator for ``"sum"``, or for ``"replica_mean"`` if counting.

  Counting appends a row of ones at index ``rows`` to every push. The take
  sums the pushes it aggregates, so its count row holds exactly how many
  there were (more than ``replicas_to_aggregate`` when extra fresh ones
  arrived first, as a dense accumulator also counts), in the same atomic
  take as the rows it divides. Rows absent from a gradient add zero, which
  is what averaging the densified gradients gives.

  Expects sorted, unique indices (the optimizer combines duplicates first):
  a SUM accumulator, like stock's MEAN one, assumes them in every push.
  """
  accum = tf.compat.v1.SparseConditionalAccumulator(
      grad.dtype, shape=(), shared_name=shared_name(var, prefix),
      reduction_type="SUM")
  shape = var.get_shape()
  if count_rows:
    rows = tf.compat.dimension_value(shape[0])
    # The extra row makes the accumulator's dense shape one row taller; the
    # chief's drain pushes a zero gradient of this shape.
    shape = tf.TensorShape([rows + 1]).concatenate(shape[1:])
    with tf.compat.v1.name_scope("replica_mean"):
      grad = _append_count_row(grad, rows, var)
  # After the count row: it crosses with the rows (ones are exact in 16 bits).
  with tf.control_dependencies(gate):
    push = accum.apply_indexed_slices_grad(
        arrive(_cross(wire, grad, shape)), local_step=local_step)
  take = accum.take_indexed_slices_grad(replicas_to_aggregate)
  if count_rows:
    with tf.compat.v1.name_scope("replica_mean"):
      take = _divide_by_count_row(take, rows, var)
  return AccumulatorOps(accum, var.device, push, take, var.op.name,
                        shared_name(var, prefix), shape, True)


def _dense_shape(rows, var, values):
  """``rows`` rows of ``var``'s row shape, as an int64 ``dense_shape``."""
  if var.get_shape().is_fully_defined():
    return tf.constant([rows] + var.get_shape().as_list()[1:], tf.int64)
  return tf.concat([tf.constant([rows], tf.int64),
                    tf.shape(values, out_type=tf.int64)[1:]], 0)


def _append_count_row(grad, rows, var):
  """``grad`` plus a row of ones at index ``rows`` (past every real row).

  Built beside the gradient (the worker, if it has a device) so the ps only
  receives it. Index ``rows`` is larger than every valid index, so sorted
  indices stay sorted. An empty gradient still gets its count row: it is one
  of the aggregated gradients, contributing zero to every row.
  """
  with tf.compat.v1.device(grad.values.device):
    ones = tf.ones(tf.concat([[1], tf.shape(grad.values)[1:]], 0),
                   grad.dtype, name="count_row")
    return tf.IndexedSlices(
        tf.concat([grad.values, ones], 0),
        tf.concat([tf.cast(grad.indices, tf.int64),
                   tf.constant([rows], tf.int64)], 0),
        _dense_shape(rows + 1, var, grad.values))


def _divide_by_count_row(take, rows, var):
  """The take's real rows divided by its count row, which is dropped.

  Rows are told apart by index (``< rows``), not by position. Every pushed
  gradient carries a count row, so a take (of at least one) always has it.
  The dense shape is the variable's, not the accumulator's.
  """
  # The take op declares no static rank; boolean_mask needs the mask's.
  indices = tf.ensure_shape(take.indices, [None])
  real = indices < rows
  # One row, the count in every element: the division broadcasts it.
  count = tf.boolean_mask(take.values, tf.equal(indices, rows))
  values = tf.boolean_mask(take.values, real) / count
  return tf.IndexedSlices(values, tf.boolean_mask(indices, real),
                          _dense_shape(rows, var, take.values))


def reduction_type(entry):
  """How ``entry``'s accumulator reduces: ``"MEAN"`` or ``"SUM"``.

  A reader that opens the shared accumulator before the job has created it
  (e.g. ``sync-replicas-status`` against a fresh ps) creates it with the
  reduction it asked for, and the job then silently reduces that way;
  readers must ask for this one.
  """
  return entry.accumulator.accumulator_ref.op.get_attr(
      "reduction_type").decode("ascii")


def set_global_step_ops(accumulators, global_step, *, start, after, scope):
  """The chief's per-accumulator init: clear leftovers, then set the step.

  Unless this is the job's first start (``start.may_hold_leftovers``), each
  accumulator of static shape is emptied of whatever an earlier chief's
  workers had pushed (``_Clearing``); then, on its device and after that
  device's clearing, stock's ``SetGlobalStep`` sets its step to the
  (generation-encoded) global step. The clearing ops live in ``scope`` and
  are built first; the final ops keep stock's names and order.

  Args:
    accumulators: ``AccumulatorOps`` entries.
    global_step: The global step variable.
    start: The ``_restart.ChiefStart`` of this ``chief_init_op``: one read
      of the step and of the generation for every accumulator (per
      accumulator they were one op each, or more: issue 20's build time).
    after: An op everything here must follow (the generation's start).
    scope: Our own name scope for the clearing ops.

  Returns:
    The final ``SetGlobalStep`` ops.
  """
  with tf.control_dependencies([after]):
    clearing = _Clearing(start.step, start.may_hold_leftovers, scope=scope)
  for entry in accumulators:
    if entry.shape.is_fully_defined():
      clearing.clear(entry)
  ops = []
  for entry in accumulators:
    with tf.compat.v1.device(entry.device):
      # Stock reads the step right here, as its set-step's input. With
      # generations the set-step takes the shared encoded step instead, and
      # the read stays, unused, so that stock's ops keep their names.
      read = tf.convert_to_tensor(global_step)
      wait = (clearing.join(entry.device) if entry.shape.is_fully_defined()
              else after)
      with tf.control_dependencies([wait]):
        ops.append(entry.accumulator.set_global_step(
            start.step if start.encoded else read, name="SetGlobalStep"))
  return ops


class _Clearing:
  """Zero pushes and takes that run only where leftovers may exist.

  One ``Switch`` of the (encoded) global step on the job's predicate; on
  each device, the pushes follow the ``Switch``'s live side (a pivot, as
  ``tf.cond`` v1 has), so on the job's first start every push and take is
  dead, not run, and a gradient a non-chief pushed before
  ``chief_init_op`` counts, as with stock (issue 16). Raw ``Switch`` and
  ``Merge`` rather than ``tf.cond``, whatever the control-flow version.

  Each accumulator costs two ops, its push and its take (issue 20's build
  time): the push's step is the largest int64, so no accumulator drops it
  as stale whatever step it holds (one restored ahead of the global step
  included), and it needs no set-step before it; the zero gradient, that
  step and the take's count are constants shared on a device; and the
  join is one ``Identity`` and one ``Merge`` per device, after all of its
  takes, so no control edge crosses devices.
  """

  def __init__(self, step, pred, *, scope):
    self._scope = scope
    with tf.compat.v1.device(step.device), tf.compat.v1.name_scope(scope):
      self._skip, self._go = tf.raw_ops.Switch(data=step, pred=pred,
                                               name="clear_switch")
    self._shared = {}  # (device, what) -> a tensor built once per device
    self._takes = collections.defaultdict(list)  # device -> takes
    self._joins = {}  # device -> the join of its takes

  def clear(self, entry):
    """Pushes a zero gradient into ``entry`` and takes once: the take
    returns at once and discards the leftovers with it. Before ``join``
    is built for its device."""
    device = entry.device
    with tf.compat.v1.device(device), tf.compat.v1.name_scope(self._scope):
      pivot = self._once(device, "pivot", lambda: tf.identity(
          self._go, name="clear_pivot").op)
      with tf.control_dependencies([pivot]):
        push = self._zero_push(entry)
      with tf.control_dependencies([push]):
        count = self._once(device, "count", lambda: tf.constant(1))
        if entry.sparse:
          take = entry.accumulator.take_indexed_slices_grad(
              count, name="drain_take").values.op
        else:
          take = entry.accumulator.take_grad(count, name="drain_take").op
    self._takes[device].append(take)

  def join(self, device):
    """An op live either way, once every clearing on ``device`` is done
    (or dead)."""
    if device not in self._joins:
      with tf.compat.v1.device(device), tf.compat.v1.name_scope(self._scope):
        with tf.control_dependencies(self._takes[device]):
          cleared = tf.identity(self._go, name="cleared")
        self._joins[device] = tf.raw_ops.Merge(
            inputs=[cleared, self._skip], name="clear_merge")[0].op
    return self._joins[device]

  def _once(self, device, what, make):
    """``make()`` the first time for ``(device, what)``, outside any
    control dependency, then the same tensor."""
    if (device, what) not in self._shared:
      with tf.control_dependencies(None):
        self._shared[device, what] = make()
    return self._shared[device, what]

  def _zero_push(self, entry):
    """A zero gradient that never is stale.

    Of ``entry.shape``, what the workers push (with "replica_mean"'s count
    row), so it fits any leftovers the take sums it with. It needs no count
    row itself: the drain discards its take.
    """
    shape, dtype = entry.shape, entry.accumulator.dtype
    never_stale = self._once(entry.device, "step", lambda: tf.constant(
        tf.int64.max, tf.int64, name="never_stale"))
    if entry.sparse:
      return entry.accumulator.apply_indexed_slices_grad(
          tf.IndexedSlices(tf.zeros([1] + shape.as_list()[1:], dtype),
                           tf.constant([0], tf.int64),
                           tf.constant(shape.as_list(), tf.int64)),
          local_step=never_stale, name="drain_push")
    zeros = self._once(entry.device, (dtype, tuple(shape.as_list())),
                       lambda: tf.zeros(shape, dtype))
    return entry.accumulator.apply_grad(zeros, local_step=never_stale,
                                        name="drain_push")

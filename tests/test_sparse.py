"""Sparse gradients with unsorted, repeated indices (what embedding lookups give).

The sparse accumulator assumes sorted, unique indices. Fed a lookup's
gradient, stock neither merges nor averages rows: two workers' gradients are
applied as their plain sum. ``combine_sparse_duplicates=True`` sorts and
combines on the worker and gets stock's per-row mean right.

``sparse_reduction`` picks how an update reduces the rows: ``"row_mean"``
(stock), ``"replica_mean"`` (as averaging the densified gradients would) or
``"sum"``.
"""

import numpy as np
import pytest
import tensorflow as tf

import sync_replicas
import support
from sync_replicas import _accumulators

# Worker 0 looks up rows 3, 1, 1; worker 1 rows 1, 0 (an embedding's
# gradient w.r.t. the table, one value row per lookup).
LOOKUPS = {0: ([3, 1, 1], [[1.0], [2.0], [4.0]]), 1: ([1, 0], [[10.0], [20.0]])}
# Combined per worker: worker 0 has row 1 = 2 + 4 = 6 and row 3 = 1; worker 1
# row 0 = 20 and row 1 = 10. Row 2 and row 4 are in neither.
# row_mean:     row 0 = 20 / 1 = 20, row 1 = (6 + 10) / 2 = 8, row 3 = 1 / 1.
# replica_mean: row 0 = 20 / 2 = 10, row 1 = (6 + 10) / 2 = 8,
#               row 3 = 1 / 2 = 0.5 (every row sum over the 2 gradients).
# sum:          row 0 = 20, row 1 = 6 + 10 = 16, row 3 = 1.
# SGD with learning rate 1 from zeros: the table is minus the update.
EXPECTED = {
    "row_mean": [-20.0, -8.0, 0.0, -1.0, 0.0],
    "replica_mean": [-10.0, -8.0, 0.0, -0.5, 0.0],
    "sum": [-20.0, -16.0, 0.0, -1.0, 0.0],
}
# Values whose mean is not exact in float32, for the dense comparison.
INEXACT_LOOKUPS = {0: ([4, 2, 4], [[0.1, 0.7], [0.3, 0.2], [0.7, 1.3]]),
                   1: ([2, 0, 2], [[1.1, 0.9], [0.6, 0.3], [0.1, 2.9]])}
ROWS = 5
PS = "/job:ps/task:0"


def _gradient(task, lookups, *, densify=False):
  indices, values = lookups[task]
  grad = tf.IndexedSlices(
      tf.constant(values), tf.constant(indices, tf.int64),
      tf.constant([ROWS, len(values[0])], tf.int64))
  # convert_to_tensor sums repeated indices: the dense gradient stock
  # would get from a dense lookup.
  return tf.convert_to_tensor(grad) if densify else grad


def _run(make_opt, *, lookups=LOOKUPS, densify=False):
  """One update of a 2-worker job; returns the table afterwards."""
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  width = len(lookups[0][1][0])
  graphs, sessions, train_ops = [], [], []
  for task in range(2):
    graph = tf.Graph()
    with graph.as_default():
      with tf.compat.v1.device(PS):
        step = tf.compat.v1.train.get_or_create_global_step()
        table = tf.compat.v1.get_variable("table", [ROWS, width],
                                          initializer=tf.zeros_initializer())
      with tf.compat.v1.device("/job:worker/task:%d" % task):
        grad = _gradient(task, lookups, densify=densify)
        opt = make_opt()
        train_ops.append(opt.apply_gradients([(grad, table)],
                                             global_step=step))
        hook = opt.make_session_run_hook(task == 0)
      sessions.append(support.monitored_session(
          cluster.worker_targets[task], is_chief=task == 0, hooks=[hook]))
      graphs.append((step, table))
  try:
    support.run_concurrently([(sessions[0].run, train_ops[0]),
                              (sessions[1].run, train_ops[1])])
    step, table = graphs[1]
    support.wait_until(lambda: sessions[1].run(step) == 1, timeout=20,
                       what="global_step == 1")
    return sessions[1].run(table)
  finally:
    for sess in reversed(sessions):
      sess.close()


def _ours(**kwargs):
  return lambda: support.OURS(support.sgd(), replicas_to_aggregate=2, **kwargs)


def test_stock_applies_the_sum_of_unsorted_duplicate_rows(impl):
  cls = impl
  table = _run(lambda: cls(support.sgd(), replicas_to_aggregate=2)).ravel()
  # Rows 1 got 2 + 4 + 10 = 16, not averaged over its two gradients.
  np.testing.assert_allclose(table, [-20.0, -16.0, 0.0, -1.0, 0.0])


def test_combined_duplicates_give_the_per_row_mean():
  table = _run(_ours(combine_sparse_duplicates=True)).ravel()
  # Per-row mean over the gradients that hold the row (stock's sparse
  # semantics): row 0 only from worker 1, row 1 (2 + 4 + 10) / 2, row 3 only
  # from worker 0.
  np.testing.assert_allclose(table, EXPECTED["row_mean"])


@pytest.mark.parametrize("reduction", ["replica_mean", "sum"])
def test_sparse_reduction_values(reduction):
  # No combine_sparse_duplicates: these reductions combine on their own.
  table = _run(_ours(sparse_reduction=reduction)).ravel()
  np.testing.assert_array_equal(table, EXPECTED[reduction])


@pytest.mark.parametrize("lookups", [LOOKUPS, INEXACT_LOOKUPS],
                         ids=["exact", "inexact"])
def test_replica_mean_equals_averaging_the_dense_gradients(lookups):
  sparse = _run(_ours(sparse_reduction="replica_mean"), lookups=lookups)
  dense = _run(_ours(), lookups=lookups, densify=True)
  # Both sum two gradients and divide by a count of 2: the same float ops.
  np.testing.assert_array_equal(sparse, dense)


# ------------------------------------------------ the accumulator, by itself


def _take_after_pushes(reduction, pushes, *, replicas_to_aggregate):
  """Builds one accumulator, pushes ``pushes`` at step 0, returns the take."""
  with tf.Graph().as_default():
    table = tf.compat.v1.get_variable("table", [ROWS, 1])
    values = tf.compat.v1.placeholder(tf.float32, [None, 1])
    indices = tf.compat.v1.placeholder(tf.int64, [None])
    grad = _accumulators.combine_duplicates(tf.IndexedSlices(
        values, indices, tf.constant([ROWS, 1], tf.int64)))
    entry = _accumulators.build(
        grad, table, local_step=tf.constant(0, tf.int64),
        replicas_to_aggregate=replicas_to_aggregate,
        sparse_reduction=reduction)
    if reduction == "replica_mean":
      # The variable's dense shape, statically, never the accumulator's
      # taller one.
      assert tf.get_static_value(entry.take.dense_shape).tolist() == [ROWS, 1]
    with tf.compat.v1.Session() as sess:
      for rows, vals in pushes:
        sess.run(entry.push, {indices: rows, values: vals})
      take = sess.run(entry.take)
  return entry, take


@pytest.mark.parametrize("reduction", sorted(EXPECTED))
def test_take_holds_only_the_variables_rows(reduction):
  entry, take = _take_after_pushes(reduction, LOOKUPS.values(),
                                   replicas_to_aggregate=2)
  assert take.indices.tolist() == [0, 1, 3]
  np.testing.assert_array_equal(take.values.ravel(),
                                -np.array(EXPECTED[reduction])[[0, 1, 3]])
  # The other two pass the accumulator's take on as stock does; it reports
  # an unknown row count (-1).
  rows = ROWS if reduction == "replica_mean" else -1
  assert take.dense_shape.tolist() == [rows, 1]
  # What is pushed (and drained on a restart): one row more for the count.
  rows = ROWS + 1 if reduction == "replica_mean" else ROWS
  assert entry.shape.as_list() == [rows, 1]
  assert entry.sparse
  # What a reader (the sync manifest) must open the accumulator with.
  assert _accumulators.reduction_type(entry) == (
      "MEAN" if reduction == "row_mean" else "SUM")


def test_replica_mean_counts_what_the_take_aggregated():
  # Three pushes for a take of 2: the accumulator hands over all three, and
  # the count row says 3, as a dense accumulator would divide by 3.
  pushes = [([1], [[3.0]]), ([1, 2], [[6.0], [9.0]]), ([], np.zeros([0, 1]))]
  _, take = _take_after_pushes("replica_mean", pushes, replicas_to_aggregate=2)
  # Row 1: (3 + 6 + 0) / 3 = 3; row 2: (0 + 9 + 0) / 3 = 3. The empty
  # gradient counts as one of the three.
  assert take.indices.tolist() == [1, 2]
  np.testing.assert_array_equal(take.values.ravel(), [3.0, 3.0])


# ------------------------------------------------------- restart and a drain


class _Task:
  """One task's graph with plain sessions, driven op by op (no threads)."""

  def __init__(self, cluster, task, *, reduction, replicas_to_aggregate=2,
               densify=False, num_tokens=-1):
    self.graph = tf.Graph()
    with self.graph.as_default():
      with tf.compat.v1.device(PS):
        self.global_step = tf.compat.v1.train.get_or_create_global_step()
        self.table = tf.compat.v1.get_variable(
            "table", [ROWS, 1], initializer=tf.zeros_initializer())
      with tf.compat.v1.device("/job:worker/task:%d" % task):
        # Stock's start: the steps below take its initial tokens.
        opt = support.OURS(support.sgd(), replicas_to_aggregate=replicas_to_aggregate,
                           total_num_replicas=2, sparse_reduction=reduction,
                           data_end="stock")
        self.opt = opt
        grad = _gradient(task, LOOKUPS, densify=densify)
        self.train_op = opt.apply_gradients([(grad, self.table)],
                                            global_step=self.global_step)
        self.init_tokens = opt.get_init_tokens_op(num_tokens)
        self.update_op = opt.get_chief_queue_runner().enqueue_ops[0]
        (accumulator, _), = opt.accumulators
        self.num_accumulated = accumulator.num_accumulated()
        self.global_init = tf.compat.v1.global_variables_initializer()
        self.local_init = tf.compat.v1.local_variables_initializer()
    self.sess = tf.compat.v1.Session(cluster.worker_targets[task],
                                     graph=self.graph,
                                     config=support.session_config(10_000))

  def start(self, *, chief, first=False):
    if first:
      self.sess.run(self.global_init)
    self.sess.run(self.local_init)
    if chief:
      self.sess.run(self.opt.chief_init_op)
      self.sess.run(self.init_tokens)
    else:
      self.sess.run(self.opt.local_step_init_op)

  def close(self):
    self.sess.close()


def _more_than_replicas_to_aggregate(reduction, *, densify=False):
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  tasks = [_Task(cluster, t, reduction=reduction, replicas_to_aggregate=1,
                 densify=densify, num_tokens=2) for t in range(2)]
  chief, worker = tasks
  try:
    chief.start(chief=True, first=True)
    worker.start(chief=False)
    # Both push at step 0 before the chief takes: its take of 1 gets both.
    for task in tasks:
      task.sess.run(task.train_op)
    assert chief.sess.run(chief.num_accumulated) == 2
    chief.sess.run(chief.update_op)
    return chief.sess.run(chief.table).ravel()
  finally:
    for task in reversed(tasks):
      task.close()


def test_replica_mean_divides_by_the_count_not_replicas_to_aggregate():
  table = _more_than_replicas_to_aggregate("replica_mean")
  # replicas_to_aggregate is 1, yet the take summed 2 gradients: divided by
  # 2 (dividing by 1 would give the sum, [-20, -16, 0, -1, 0]).
  np.testing.assert_array_equal(table, EXPECTED["replica_mean"])
  dense = _more_than_replicas_to_aggregate("row_mean", densify=True)
  np.testing.assert_array_equal(table, dense)


def test_restarted_chief_drains_the_counting_accumulator():
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  chief = _Task(cluster, 0, reduction="replica_mean")
  worker = _Task(cluster, 1, reduction="replica_mean")
  try:
    chief.start(chief=True, first=True)
    worker.start(chief=False)
    worker.sess.run(worker.train_op)  # Fresh at step 0, count row and all.
    assert worker.sess.run(worker.num_accumulated) == 1
    # The chief dies before its update; a new chief's init drains the
    # leftover with a zero push of the accumulator's (taller) shape.
    chief.close()
    chief = _Task(cluster, 0, reduction="replica_mean")
    chief.start(chief=True)
    assert worker.sess.run(worker.num_accumulated) == 0
    # The worker's next push carries its old-lifetime local step: stale, and
    # it takes one of the new tokens. The new chief's first push is fresh
    # (its local step is the new generation's, as a starting replica's is
    # the global step with stock); then the worker pushes fresh.
    worker.sess.run(worker.train_op)
    assert chief.sess.run(chief.num_accumulated) == 0
    chief.sess.run(chief.train_op)
    assert chief.sess.run(chief.num_accumulated) == 1
    chief.sess.run(chief.init_tokens)  # A token for the worker's next wait.
    worker.sess.run(worker.train_op)
    assert chief.sess.run(chief.num_accumulated) == 2
    chief.sess.run(chief.update_op)
    # Exactly one update from the two fresh gradients: a leftover in the
    # take would have made the count 3 and added its rows.
    np.testing.assert_array_equal(chief.sess.run(chief.table).ravel(),
                                  EXPECTED["replica_mean"])
  finally:
    worker.close()
    chief.close()


# ------------------------------------------------------------ graph and checks


def _build_graph(**kwargs):
  """An embedding model on a ps; returns the graph and its op signatures."""
  graph = tf.Graph()
  with graph.as_default():
    with tf.compat.v1.device(PS):
      step = tf.compat.v1.train.get_or_create_global_step()
      table = tf.compat.v1.get_variable("table", [ROWS, 2])
      w = tf.compat.v1.get_variable("w", [2])
    with tf.compat.v1.device("/job:worker/task:0"):
      h = tf.nn.embedding_lookup(table, tf.constant([3, 1, 3]))
      opt = support.OURS(tf.compat.v1.train.AdamOptimizer(0.1),
                         replicas_to_aggregate=2, **kwargs)
      opt.minimize(tf.reduce_sum(h * w), global_step=step)
  return graph, {(op.name, op.type, op.device)
                 for op in graph.get_operations()}


def _sum_accumulators(graph):
  return [op for op in graph.get_operations()
          if op.type == "SparseConditionalAccumulator"
          and op.get_attr("reduction_type") == b"SUM"]


def test_default_reduction_builds_the_default_graph():
  graph, default = _build_graph()
  explicit_graph, explicit = _build_graph(sparse_reduction="row_mean")
  assert default == explicit
  assert not _sum_accumulators(graph) and not _sum_accumulators(explicit_graph)
  assert not any("replica_mean" in name for name, _, _ in default)


@pytest.mark.parametrize("reduction", ["replica_mean", "sum"])
def test_other_reductions_build_one_sum_accumulator_on_the_ps(reduction):
  graph, _ = _build_graph(sparse_reduction=reduction)
  accumulator, = _sum_accumulators(graph)
  assert accumulator.device == PS
  # The stock shared name: status tools and restarts find it as before.
  assert accumulator.get_attr("shared_name") == b"table:0/grad_accum"
  count_rows = [op for op in graph.get_operations()
                if op.name.endswith("count_row")]
  if reduction == "sum":
    assert not count_rows
  else:
    # Built beside the gradient, so the ps only receives it.
    assert [op.device for op in count_rows] == ["/job:worker/task:0"]


@pytest.mark.parametrize("value", ["mean", "ROW_MEAN", None])
def test_unknown_reduction_is_refused_before_any_op(value, graph):
  with pytest.raises(ValueError, match=r"sparse_reduction must be one of "
                                       r"row_mean, replica_mean, sum, got"):
    support.OURS(support.sgd(), replicas_to_aggregate=2, sparse_reduction=value)
  with pytest.raises(ValueError, match=r"sparse_reduction must be one of"):
    _accumulators.check_sparse_reduction([], value)
  assert not graph.get_operations()


def _unknown_rows_model():
  step = tf.compat.v1.train.get_or_create_global_step()
  # The row count is not known while the graph is built.
  table = tf.compat.v1.Variable(tf.zeros([ROWS, 1]), name="table",
                                shape=tf.TensorShape([None, 1]))
  grad = tf.IndexedSlices(tf.constant([[1.0]]), tf.constant([2], tf.int64))
  return step, table, grad


def test_replica_mean_needs_a_known_row_count(graph):
  step, table, grad = _unknown_rows_model()
  opt = support.OURS(support.sgd(), replicas_to_aggregate=2,
                     sparse_reduction="replica_mean")
  before = len(graph.get_operations())
  with pytest.raises(ValueError) as err:
    opt.apply_gradients([(grad, table)], global_step=step)
  assert len(graph.get_operations()) == before
  assert not opt.is_built
  message = str(err.value)
  # What was expected, what arrived, how to fix it.
  assert "needs the number of rows" in message
  assert "Variable table has shape (None, 1)" in message
  assert "static shape" in message and '"row_mean" or "sum"' in message


@pytest.mark.parametrize("reduction", ["row_mean", "sum"])
def test_other_reductions_need_no_row_count(reduction, graph):
  step, table, grad = _unknown_rows_model()
  opt = support.OURS(support.sgd(), replicas_to_aggregate=2,
                     sparse_reduction=reduction)
  opt.apply_gradients([(grad, table)], global_step=step)
  assert opt.is_built
  del graph


def test_replica_mean_with_dense_gradients_needs_no_row_count(graph):
  del graph
  step, table, _ = _unknown_rows_model()
  opt = support.OURS(support.sgd(), replicas_to_aggregate=2,
                     sparse_reduction="replica_mean")
  opt.apply_gradients([(tf.ones_like(table), table)], global_step=step)
  assert opt.is_built

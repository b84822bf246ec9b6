"""Several sync optimizers in one job (TensorFlow issues 11071, 24338).

Stock gives every instance the shared name ``sync_token_q``, so a GAN's two
optimizers share one token queue. Ours keeps stock's names for the default
``name`` and prefixes them with any other name.
"""

import numpy as np
import pytest
import tensorflow as tf

import sync_replicas
import support

pytestmark = pytest.mark.quick  # In ./tools/test --quick.


def _shared_names(graph, op_type):
  return sorted(op.get_attr("shared_name").decode()
                for op in graph.get_operations() if op.type == op_type)


def _build(cls, task, names):
  """Two optimizers on disjoint variables, each with its own global step."""
  graph = tf.Graph()
  with graph.as_default():
    ops = {}
    for i, name in enumerate(names):
      with tf.compat.v1.device("/job:ps/task:0"):
        step = tf.compat.v1.get_variable(
            "%s_step" % name, [], tf.int64, trainable=False,
            initializer=tf.zeros_initializer())
        var = tf.compat.v1.get_variable(
            "%s_w" % name, [2], initializer=tf.zeros_initializer())
      with tf.compat.v1.device("/job:worker/task:%d" % task):
        opt = cls(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                  replicas_to_aggregate=2, total_num_replicas=2, name=name)
        grad = tf.constant([1.0, 2.0]) * (i + 1) * (task + 1)
        ops[name] = (opt.apply_gradients([(grad, var)], global_step=step),
                     opt.make_session_run_hook(task == 0), step, var)
  return graph, ops


def test_default_name_keeps_stock_shared_names_others_are_prefixed():
  graph, _ = _build(support.OURS, 0, ["sync_replicas", "disc"])
  assert _shared_names(graph, "FIFOQueueV2") == [
      "disc/sync_token_q", "disc/sync_token_q_generations", "sync_token_q",
      "sync_token_q_generations"]
  assert _shared_names(graph, "ResourceConditionalAccumulator") == [
      "disc/disc_w:0/grad_accum", "sync_replicas_w:0/grad_accum"]
  stock_graph, _ = _build(support.STOCK, 0, ["gen", "disc"])
  # Stock: one token queue for both.
  assert _shared_names(stock_graph, "FIFOQueueV2") == ["sync_token_q",
                                                        "sync_token_q"]


def test_two_optimizers_train_disjoint_variables_across_a_cluster():
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  names = ["gen", "disc"]
  built = [_build(support.OURS, t, names) for t in range(2)]
  sessions = []
  for task, (graph, ops) in enumerate(built):
    with graph.as_default():
      sessions.append(support.monitored_session(
          cluster.worker_targets[task], is_chief=task == 0,
          hooks=[ops[n][1] for n in names]))

  def round_of(task):
    _, ops = built[task]
    for name in names:  # Alternate, as a GAN's training loop does.
      sessions[task].run(ops[name][0])

  try:
    for _ in range(4):
      support.run_concurrently([(round_of, 0), (round_of, 1)])
    _, ops = built[0]
    for i, name in enumerate(names):
      step = ops[name][2]
      # Every round updates (data_end="train_all" gives no spare initial
      # token, whose stale round stock has): 4 updates per optimizer, none
      # lost to the other.
      support.wait_until(lambda s=step: sessions[0].run(s) == 4, timeout=20,
                         what="%s's global step == 4" % name)
      mean_grad = np.array([1.0, 2.0]) * (i + 1) * 1.5  # tasks 1 and 2
      np.testing.assert_allclose(sessions[0].run(ops[name][3]),
                                 -4 * mean_grad, rtol=1e-6)
  finally:
    for sess in reversed(sessions):
      sess.close()

"""The session hook: created early, checked late, and what it runs."""

import pytest
import tensorflow as tf

import sync_replicas
import support

pytestmark = pytest.mark.quick  # In ./tools/test --quick.


@pytest.mark.parametrize("is_chief", [True, False], ids=["chief", "worker"])
def test_begin_raises_before_apply_gradients(impl, is_chief):
  opt = impl(support.sgd(), replicas_to_aggregate=1, total_num_replicas=1)
  hook = opt.make_session_run_hook(is_chief)
  with pytest.raises(ValueError, match="apply_gradient should be called"):
    hook.begin()


def test_hook_can_be_created_before_minimize(graph):
  del graph
  opt = sync_replicas.SyncReplicasOptimizer(support.sgd(), replicas_to_aggregate=1,
                                            total_num_replicas=1)
  hook = opt.make_session_run_hook(True)
  assert isinstance(hook, sync_replicas.SyncReplicasOptimizerHook)
  assert isinstance(hook, tf.compat.v1.train.SessionRunHook)
  v = tf.compat.v1.Variable([0.0])
  gs = tf.compat.v1.Variable(0, name="global_step", trainable=False)
  opt.minimize(v, global_step=gs)
  hook.begin()


def test_variables_and_slots_come_from_the_wrapped_optimizer(graph):
  del graph
  opt = sync_replicas.SyncReplicasOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.01), replicas_to_aggregate=1,
      total_num_replicas=1)
  v = tf.compat.v1.Variable([0.0], name="fetch_variable_test")
  gs = tf.compat.v1.Variable(0, name="global_step", trainable=False)
  opt.minimize(v, global_step=gs)
  # TensorFlow's own test reads the wrapped optimizer through ``_opt``.
  beta1_power, beta2_power = opt._opt._get_beta_accumulators()  # pylint: disable=protected-access
  assert beta1_power in opt.variables() and beta2_power in opt.variables()
  assert opt.local_step not in opt.variables()
  assert sorted(opt.get_slot_names()) == ["m", "v"]
  assert opt.get_slot(v, "m") is opt._opt.get_slot(v, "m")  # pylint: disable=protected-access


def test_single_worker_trains_in_a_monitored_session():
  """One replica aggregating one gradient: plain synchronous SGD."""
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        ps_tasks=1, worker_device="/job:worker/task:0")):
      gs = tf.compat.v1.train.get_or_create_global_step()
      w = tf.compat.v1.Variable(4.0)
      loss = tf.square(w)
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.25),
          replicas_to_aggregate=1)
      train_op = opt.minimize(loss, global_step=gs)
    hooks = [opt.make_session_run_hook(True),
             tf.compat.v1.train.StopAtStepHook(last_step=5)]
    runs = 0
    with support.monitored_session(cluster.worker_targets[0], is_chief=True,
                                   hooks=hooks) as sess:
      while not sess.should_stop():
        sess.run(train_op)
        runs += 1
    with tf.compat.v1.Session(cluster.worker_targets[0],
                              config=support.session_config()) as plain:
      final_step, final_w = plain.run([gs, w])
  assert final_step >= 5
  # No run's gradient is stale: data_end="train_all" gives no spare
  # initial token to push a second time at step 0 (stock: runs == step + 1).
  # Every update halves w (w -= 0.25 * 2w).
  assert runs == final_step
  assert final_w == pytest.approx(4.0 * 0.5 ** final_step)

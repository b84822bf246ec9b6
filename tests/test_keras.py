"""Keras 2 legacy optimizers: stock refuses them, ours trains to v1's numbers.

``tf_keras.optimizers.legacy.SGD`` and ``Adam`` (Keras 2's OptimizerV2, which
runs in graph mode) are wrapped by our class through ``_keras``'s adapter.
The numbers are checked side by side against the same v1 optimizer on the
wave scenarios of ``test_parity`` (2 workers aggregating 2, dense, matrix and
sparse gradients and one variable without a gradient): SGD to the bit, Adam
to float32 rounding on values near 1 (Keras computes Adam's bias correction
as a power, v1 as a running product, and its sparse update in another
order).
"""

import sys

import numpy as np
import pytest
import tensorflow as tf

import support
import sync_replicas
import test_parity
from sync_replicas import legacy

pytestmark = pytest.mark.keras  # Keras in pytest's own process.

tf_keras = support.require(
    "tf_keras", why="tests/test_keras.py trains Keras 2's legacy optimizers",
    install="setup.cfg's keras2 extra pins it: pip install --no-deps "
    "'tf_keras==<your TensorFlow's minor version>.*' (tools/_env.sh does)")

LR = test_parity.LR

#: The same optimizer as Keras 2 legacy and as v1, with v1's defaults made
#: explicit where Keras's differ (Adam's epsilon: 1e-7 vs 1e-8).
PAIRS = {
    "sgd": (lambda: tf_keras.optimizers.legacy.SGD(LR),
            lambda: tf.compat.v1.train.GradientDescentOptimizer(LR)),
    "adam": (lambda: tf_keras.optimizers.legacy.Adam(LR, epsilon=1e-8),
             lambda: tf.compat.v1.train.AdamOptimizer(LR, epsilon=1e-8)),
}


def _model():
  with tf.compat.v1.device("/job:ps/task:0"):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    var = tf.compat.v1.get_variable("v", initializer=tf.constant([1.0, 2.0]))
  loss = tf.reduce_sum(tf.square(var))
  return global_step, var, loss


def test_stock_refuses_a_keras_legacy_optimizer_where_ours_trains(graph):
  global_step, var, loss = _model()
  stock = support.STOCK(tf_keras.optimizers.legacy.SGD(0.1),
                        replicas_to_aggregate=1)
  with pytest.raises(AttributeError, match="compute_gradients"):
    stock.minimize(loss, global_step=global_step)
  # Given gradients, stock passes the global step where Keras expects a name.
  with pytest.raises(TypeError):
    stock.apply_gradients([(tf.constant([1.0, 1.0]), var)],
                          global_step=global_step)

  ours = support.OURS(tf_keras.optimizers.legacy.SGD(0.1),
                      replicas_to_aggregate=1)
  assert ours.minimize(loss, global_step=global_step) is not None
  assert ours.is_built


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_keras_legacy_optimizer_matches_the_v1_optimizer(name):
  keras_opt, v1_opt = PAIRS[name]
  kwargs = dict(num_workers=2, replicas=2)
  v1_runs, _ = test_parity.run_waves(
      support.OURS, test_parity.SYNC_WAVES, test_parity.SYNC_STEPS,
      make_opt=v1_opt, **kwargs)
  keras_runs, _ = test_parity.run_waves(
      support.OURS, test_parity.SYNC_WAVES, test_parity.SYNC_STEPS,
      make_opt=keras_opt, **kwargs)
  if name == "sgd":
    test_parity.assert_same_runs(v1_runs, keras_runs)
  else:
    for i, (a, b) in enumerate(zip(v1_runs, keras_runs, strict=True)):
      for j, (x, y) in enumerate(zip(a, b, strict=True)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5,
                                   err_msg="wave %d, value %d" % (i, j))
  final = keras_runs[-1]
  assert final[0] == test_parity.SYNC_STEPS[-1]  # The adapter's increment.
  assert not np.array_equal(final[3], np.ones([6, 2]))  # Sparse rows moved.
  np.testing.assert_array_equal(final[4], [3.0, 4.0])  # No gradient: kept.


def test_slots_and_variables_are_the_keras_optimizers(graph):
  global_step, var, loss = _model()
  keras_opt = tf_keras.optimizers.legacy.Adam(0.1)
  opt = sync_replicas.SyncReplicasOptimizer(keras_opt, replicas_to_aggregate=1)
  opt.minimize(loss, global_step=global_step)
  assert opt.get_slot_names() == keras_opt.get_slot_names() == ["m", "v"]
  assert opt.get_slot(var, "m") is keras_opt.get_slot(var, "m")
  assert opt.get_slot(var, "no_such_slot") is None  # As a v1 optimizer.
  assert opt.variables() == keras_opt.variables()
  # Slots beside their variable; Keras's step counter beside the global step.
  assert opt.get_slot(var, "m").device == var.device
  iterations = [v for v in keras_opt.variables() if "iter" in v.name]
  assert iterations and iterations[0].device == global_step.device


def test_reference_variables_are_refused_with_advice(graph):
  global_step = tf.compat.v1.train.get_or_create_global_step()
  var = tf.compat.v1.Variable([1.0], use_resource=False, name="ref")
  opt = sync_replicas.SyncReplicasOptimizer(
      tf_keras.optimizers.legacy.SGD(0.1), replicas_to_aggregate=1)
  with pytest.raises(TypeError, match=r"resource variables only, got "
                                      r"reference variables .*'ref:0'.*"
                                      r"use_resource=True"):
    opt.minimize(tf.reduce_sum(var), global_step=global_step)


def test_non_legacy_keras_2_optimizer_is_refused_with_its_legacy_twin():
  with pytest.raises(TypeError, match=r"tf_keras 2\).*changes nothing\. Use "
                                      r"the legacy twin tf_keras\.optimizers\."
                                      r"legacy\.SGD"):
    sync_replicas.SyncReplicasOptimizer(tf_keras.optimizers.SGD(0.1),
                                        replicas_to_aggregate=1)


def test_the_0_11_class_does_not_adapt_keras(graph):
  with pytest.raises(TypeError, match=r"does not adapt Keras 2 legacy "
                                      r"optimizers \(sync_replicas\."
                                      r"SyncReplicasOptimizer does\)"):
    legacy.SyncReplicasOptimizer(tf_keras.optimizers.legacy.SGD(0.1),
                                 replicas_to_aggregate=1, replica_id=0)


@pytest.mark.skipif(
    not hasattr(getattr(tf.keras.optimizers, "legacy", None), "SGD")
    or not str(getattr(sys.modules.get("keras"), "__version__", "")
               ).startswith("2."),
    reason="tf.keras is Keras 3 on TensorFlow %s: only tf_keras has legacy "
    "optimizers" % tf.__version__)
def test_tf_keras_legacy_optimizer_of_tensorflow_2_15_is_adapted(graph):
  global_step, _, loss = _model()
  opt = sync_replicas.SyncReplicasOptimizer(
      tf.keras.optimizers.legacy.SGD(0.1), replicas_to_aggregate=1)
  opt.minimize(loss, global_step=global_step)
  assert opt.get_slot_names() == []

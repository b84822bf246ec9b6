"""Bad input gets a clear error, raised before any op exists.

Where stock has a message its words come first (checked against stock where
stock raises at all); our detail follows.
"""

import re
import sys

import numpy as np
import pytest
import tensorflow as tf

import sync_replicas
import support

pytestmark = [pytest.mark.quick, pytest.mark.keras]  # --quick; tf.keras here.


def _model():
  gs = tf.compat.v1.train.get_or_create_global_step()
  v = tf.compat.v1.Variable([1.0, 2.0], name="v")
  return gs, v


def _op_count():
  return len(tf.compat.v1.get_default_graph().get_operations())


@pytest.mark.parametrize("value", [0, -1, 2.0, "2", True, None],
                         ids=["zero", "negative", "float", "str", "bool",
                              "none"])
def test_replicas_to_aggregate_must_be_positive_int(value):
  with pytest.raises(ValueError,
                     match=r"replicas_to_aggregate must be a positive int, "
                           r"got %s" % re.escape(repr(value))):
    sync_replicas.SyncReplicasOptimizer(support.sgd(0.1), replicas_to_aggregate=value)


def test_numpy_integers_are_accepted():
  opt = sync_replicas.SyncReplicasOptimizer(
      support.sgd(0.1), replicas_to_aggregate=np.int64(3), total_num_replicas=np.int32(4))
  assert (opt.replicas_to_aggregate, opt.total_num_replicas) == (3, 4)
  assert opt.tokens_per_step == 4


@pytest.mark.parametrize("value", [0, -2], ids=["zero", "negative"])
def test_total_num_replicas_must_be_at_least_one(value):
  with pytest.raises(ValueError,
                     match=r"total_num_replicas must be a positive int, got "
                           r"%d .*or None to use replicas_to_aggregate \(2\)"
                           % value):
    sync_replicas.SyncReplicasOptimizer(support.sgd(0.1), replicas_to_aggregate=2,
                                        total_num_replicas=value)


def test_keras_optimizer_is_rejected_with_advice():
  # tf.keras is Keras 3 from TensorFlow 2.16 on, Keras 2 on 2.15; neither's
  # non-legacy optimizer can update a variable from a graph-mode session.
  keras_opt = tf.keras.optimizers.SGD(0.1)
  why = (r"A Keras 3 optimizer cannot work in a graph-mode session.*"
         r"tf_keras\.optimizers\.legacy\.SGD"
         if _keras_major(keras_opt) >= 3 else
         r"in a graph-mode session their update runs but changes nothing\. "
         r"Use the legacy twin tf\.keras\.optimizers\.legacy\.SGD")
  with pytest.raises(TypeError, match=r"the Keras optimizer .*SGD.*" + why):
    sync_replicas.SyncReplicasOptimizer(keras_opt, replicas_to_aggregate=1)
  with pytest.raises(TypeError, match=r"tf\.compat\.v1\.train\.Gradient"):
    sync_replicas.SyncReplicasOptimizer(keras_opt, replicas_to_aggregate=1)


def _keras_major(opt):
  package = type(opt).__module__.split(".")[0]
  return int(sys.modules[package].__version__.split(".")[0])


def test_non_optimizer_is_rejected():
  with pytest.raises(TypeError, match=r"must be a tf\.compat\.v1\.train\."
                                      r"Optimizer, got 'sgd' \(builtins\.str\)"):
    sync_replicas.SyncReplicasOptimizer("sgd", replicas_to_aggregate=1)


@pytest.mark.parametrize("which", ["averages_only", "variables_only"])
def test_variable_averages_and_variables_go_together(which, graph):
  kwargs = ({"variable_averages": tf.train.ExponentialMovingAverage(0.9)}
            if which == "averages_only" else
            {"variables_to_average": [tf.compat.v1.Variable(1.0)]})
  with pytest.raises(ValueError, match="variable_averages and "
                                       "variables_to_average go together"):
    sync_replicas.SyncReplicasOptimizer(support.sgd(0.1), replicas_to_aggregate=1,
                                        **kwargs)


def test_too_few_tokens_matches_stock_words(graph):
  del graph
  gs, v = _model()
  stock = support.STOCK(support.sgd(0.1), replicas_to_aggregate=3, total_num_replicas=1)
  stock.minimize(tf.reduce_sum(v), global_step=gs)
  with pytest.raises(ValueError) as stock_err:
    stock.get_init_tokens_op(num_tokens=1)
  ours = support.OURS(support.sgd(0.1), replicas_to_aggregate=3, total_num_replicas=1)
  with tf.compat.v1.variable_scope("ours"):
    ours.minimize(tf.reduce_sum(v), global_step=gs)
  before = _op_count()
  with pytest.raises(ValueError) as ours_err:
    ours.get_init_tokens_op(num_tokens=1)
  assert _op_count() == before
  assert str(stock_err.value) == (
      "Too few tokens to finish the first step: 1 (given) vs 2 (needed)")
  assert str(ours_err.value).startswith(str(stock_err.value))
  assert "pass num_tokens >= 2" in str(ours_err.value)


def test_chief_hook_checks_num_tokens_when_made(graph):
  del graph
  opt = support.OURS(support.sgd(0.1), replicas_to_aggregate=4, total_num_replicas=2)
  with pytest.raises(ValueError, match=r"Too few tokens to finish the first "
                                       r"step: 0 \(given\) vs 2 \(needed\)"):
    opt.make_session_run_hook(is_chief=True, num_tokens=0)
  # A non-chief never enqueues tokens, so stock ignores its num_tokens.
  opt.make_session_run_hook(is_chief=False, num_tokens=0)


@pytest.mark.parametrize("num_tokens", [-2, 1.5, "3"])
def test_num_tokens_must_be_minus_one_or_a_count(num_tokens, graph):
  del graph
  opt = support.OURS(support.sgd(0.1), replicas_to_aggregate=2, total_num_replicas=4)
  with pytest.raises(ValueError, match="num_tokens"):
    opt.make_session_run_hook(is_chief=True, num_tokens=num_tokens)


def test_apply_gradients_twice_is_refused(graph):
  gs, v = _model()
  opt = support.OURS(support.sgd(0.1), replicas_to_aggregate=1)
  opt.minimize(tf.reduce_sum(v), global_step=gs)
  grads = opt.compute_gradients(tf.reduce_sum(v))
  before = len(graph.get_operations())
  with pytest.raises(RuntimeError, match="apply_gradients.. was already "
                                         "called .*create one optimizer per "
                                         "train op"):
    opt.apply_gradients(grads, global_step=gs)
  assert len(graph.get_operations()) == before


def test_missing_global_step_matches_stock_words(graph):
  _, v = _model()
  grads = [(tf.ones([2]), v)]
  with pytest.raises(ValueError, match="^Global step is required to check "
                                       "staleness$"):
    support.STOCK(support.sgd(0.1), replicas_to_aggregate=1).apply_gradients(grads)
  grads = [(tf.ones([2]), v)]
  before = len(graph.get_operations())
  with pytest.raises(ValueError, match="^Global step is required to check "
                                       "staleness. Pass global_step="):
    support.OURS(support.sgd(0.1), replicas_to_aggregate=1).apply_gradients(grads)
  assert len(graph.get_operations()) == before


@pytest.mark.parametrize("make_step", [
    lambda: tf.compat.v1.Variable(0.0, name="float_step"),
    lambda: 7,
], ids=["float_variable", "python_int"])
def test_global_step_must_be_integer_variable(make_step, graph):
  _, v = _model()
  step = make_step()
  grads = [(tf.ones([2]), v)]
  before = len(graph.get_operations())
  with pytest.raises(ValueError, match="int32 or int64"):
    support.OURS(support.sgd(0.1), replicas_to_aggregate=1).apply_gradients(
        grads, global_step=step)
  assert len(graph.get_operations()) == before


@pytest.mark.parametrize("grads_and_vars", [[], (), iter(())],
                         ids=["list", "tuple", "iterator"])
def test_empty_grads_and_vars_matches_stock_words(grads_and_vars, graph):
  gs, _ = _model()
  before = len(graph.get_operations())
  with pytest.raises(ValueError, match="^Must supply at least one variable$"):
    support.OURS(support.sgd(0.1), replicas_to_aggregate=1).apply_gradients(
        grads_and_vars, global_step=gs)
  assert len(graph.get_operations()) == before


def test_unknown_gradient_type_is_named(graph):
  gs, v = _model()
  w = tf.compat.v1.Variable(1.0, name="w")
  grads = [(tf.ones([2]), v), (np.ones(()), w)]
  before = len(graph.get_operations())
  with pytest.raises(ValueError, match=r"^Unknown grad type! .*for variable "
                                       r"w:0, got ndarray"):
    support.OURS(support.sgd(0.1), replicas_to_aggregate=1).apply_gradients(
        grads, global_step=gs)
  # Checked before anything was built, even for the valid first pair.
  assert len(graph.get_operations()) == before


def test_all_gradients_none_is_refused_before_building(graph):
  gs, v = _model()
  before = len(graph.get_operations())
  with pytest.raises(ValueError, match="No gradients provided for any "
                                       "variable"):
    support.OURS(support.sgd(0.1), replicas_to_aggregate=1).apply_gradients(
        [(None, v)], global_step=gs)
  assert len(graph.get_operations()) == before


def test_queue_runner_and_tokens_need_apply_gradients_first(impl):
  opt = impl(support.sgd(0.1), replicas_to_aggregate=1)
  with pytest.raises(ValueError, match="^Should be called after "
                                       r"apply_gradients\(\)."):
    opt.get_chief_queue_runner()
  with pytest.raises(ValueError, match=r"^get_init_tokens_op\(\) should be "
                                       r"called after apply_gradients\(\)."):
    opt.get_init_tokens_op()


def test_built_attributes_are_absent_before_apply_gradients():
  opt = support.OURS(support.sgd(0.1), replicas_to_aggregate=1)
  stock = support.STOCK(support.sgd(0.1), replicas_to_aggregate=1)
  for name in ("chief_init_op", "local_step_init_op",
               "ready_for_local_init_op"):
    # Stock has no such attribute yet: hasattr stays False for both.
    assert not hasattr(stock, name)
    assert not hasattr(opt, name)
    with pytest.raises(sync_replicas.NotBuiltError, match=name):
      getattr(opt, name)
  assert not opt.is_built

"""pack_variable_reads: any model's reads packed, the numbers a plain read's.

* Parity: the same model trained with stock's optimizer, with ours and with
  ours and ``pack_variable_reads=True`` ends on the same values to the bit,
  for each way of building it (plain ``tf.compat.v1`` code on resource and
  on ref variables, Keras 2 layers from ``tf_keras``, tf-slim layers, an
  Estimator's model_fn where TensorFlow still has the Estimator). The
  model_fn is called here directly and its train_op run, for the numbers;
  ``Estimator.train`` itself with the option (turned on by the environment
  variable, on a ps/chief/worker process cluster) is
  tests/test_estimator.py's
  ``test_estimator_train_packs_reads_from_the_environment``.
* What is packed and what is left plain (huge, non-float, alone, under
  control dependencies, inside control flow, gathers), counted; partitioned
  variables' parts packed like any others.
* Traced on a real cluster: 40 variables over 2 ps tasks, 2 tensors cross
  instead of 40.
* The option: keyword, environment variable, bad values refused.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import _packing
from sync_replicas import _rewired_reads

SHARED = support.SharedCluster(num_workers=1, num_ps=2)
# Closing stock's chief session ends its blocked queue-runner thread with a
# CancelledError traceback: stock's known behaviour, not this test's failure.
pytestmark = [pytest.mark.keras, pytest.mark.filterwarnings(  # keras: 2.15's Estimator
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")]
LR = 0.5
#: The global step after each push of a parity run.
STEPS = (1, 1, 2, 3, 4)
#: tf.compat.v1.estimator, on a TensorFlow that still has it (up to 2.15).
ESTIMATOR = getattr(tf.compat.v1, "estimator", None)


def _setter():
  return tf.compat.v1.train.replica_device_setter(
      ps_tasks=2, worker_device="/job:worker/task:0")


def _data():
  rng = np.random.default_rng(5)
  x = rng.integers(-8, 9, size=[8, 6]).astype(np.float32) / 8
  y = rng.integers(-8, 9, size=[8, 3]).astype(np.float32) / 8
  return tf.constant(x), tf.constant(y)


def _v1_model(use_resource):
  def build():
    x, y = _data()
    with tf.compat.v1.variable_scope("v1", use_resource=use_resource):
      w1 = tf.compat.v1.get_variable("w1", [6, 5])
      b1 = tf.compat.v1.get_variable("b1", [5])
      w2 = tf.compat.v1.get_variable("w2", [5, 3])
      b2 = tf.compat.v1.get_variable("b2", [3])
    hidden = tf.nn.relu(tf.matmul(x, w1) + b1)
    return tf.reduce_mean(tf.square(tf.matmul(hidden, w2) + b2 - y)), None
  return build


def _keras_model():
  tf_keras = support.require(
      "tf_keras", why="tests/test_rewired_reads.py builds Keras 2 layers",
      install="setup.cfg's keras2 extra pins it")
  x, y = _data()
  rng = np.random.default_rng(9)
  # Keras draws its own seeds: constants keep every run's start the same.
  init = lambda *shape: tf_keras.initializers.Constant(
      rng.normal(size=shape).astype(np.float32))
  model = tf_keras.Sequential([
      tf_keras.layers.Dense(5, activation="relu", kernel_initializer=init(6, 5),
                            bias_initializer=init(5)),
      tf_keras.layers.Dense(3, kernel_initializer=init(5, 3),
                            bias_initializer=init(3))])
  loss = tf.reduce_mean(tf.square(model(x) - y))
  return loss, model.trainable_weights


def _slim_model():
  tf_slim = support.require(
      "tf_slim", why="tests/test_rewired_reads.py builds tf-slim layers")
  x, y = _data()
  # tf-slim scripts of TF1's time made ref variables.
  with tf.compat.v1.variable_scope("slim", use_resource=False):
    hidden = tf_slim.fully_connected(x, 5)
    out = tf_slim.fully_connected(hidden, 3, activation_fn=None)
  return tf.reduce_mean(tf.square(out - y)), None


def _estimator_spec(features, labels, mode, sync_opt):
  """An Estimator model_fn, as a script would write it: two layers, so
  that each of the two ps tasks holds two variables to pack (one variable
  alone on its task crosses as a plain read)."""
  w1 = tf.compat.v1.get_variable("w1", [6, 5])
  b1 = tf.compat.v1.get_variable("b1", [5])
  w2 = tf.compat.v1.get_variable("w2", [5, 3])
  b2 = tf.compat.v1.get_variable("b2", [3])
  hidden = tf.nn.relu(tf.matmul(features, w1) + b1)
  loss = tf.reduce_mean(tf.square(tf.matmul(hidden, w2) + b2 - labels))
  train_op = sync_opt.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.compat.v1.estimator.EstimatorSpec(mode, loss=loss,
                                              train_op=train_op)


STYLES = {
    "v1-resource": _v1_model(True),
    "v1-ref": _v1_model(False),
    "keras": _keras_model,
    "slim": _slim_model,
    # Built by the model_fn itself, below, called without Estimator.train:
    # the numbers need one replica on a ps cluster, which the Estimator's
    # in-process tests lack. Estimator.train with the option is proven in
    # tests/test_estimator.py (the packed-reads cluster test).
    "estimator": None,
}


def _train(style, opt_cls, **options):
  """The model's variables after the pushes of STEPS, and the packed reads'
  concatenations."""
  with SHARED.use() as cluster:
    g = tf.Graph()
    with g.as_default(), tf.compat.v1.device(_setter()):
      tf.compat.v1.set_random_seed(11)
      global_step = tf.compat.v1.train.get_or_create_global_step()
      if opt_cls is support.OURS:
        # Stock's start (its spare initial token makes the second push
        # stale, as STEPS says), so that the numbers compare with stock's.
        options = {"data_end": "stock", **options}
      opt = opt_cls(tf.compat.v1.train.GradientDescentOptimizer(LR),
                    replicas_to_aggregate=1, total_num_replicas=1, **options)
      if style == "estimator":
        x, y = _data()
        train_op = _estimator_spec(x, y, ESTIMATOR.ModeKeys.TRAIN,
                                   opt).train_op
      else:
        loss, var_list = STYLES[style]()
        train_op = opt.minimize(loss, global_step=global_step,
                                var_list=var_list)
      hook = opt.make_session_run_hook(True)
      variables = tf.compat.v1.trainable_variables()
    with g.as_default(), support.monitored_session(
        cluster.worker_targets[0], is_chief=True, hooks=[hook]) as sess:
      # Each push waits for the update before it, so every run takes the same
      # path: the second push is stale (the initial token carries step 0) and
      # dropped, as in stock.
      for expected in STEPS:
        sess.run(train_op)
        support.wait_until(lambda e=expected: sess.run(global_step) == e,
                           timeout=30, what="global step %d" % expected)
      values = sess.run(variables)
    packed = [op for op in g.get_operations()
              if op.type == "ConcatV2" and "/packed_reads/" in op.name]
    return {v.op.name: value
            for v, value in zip(variables, values, strict=True)}, packed


# tf-slim's layers call TensorFlow's legacy `layer.apply`, which warns that
# it is deprecated: TensorFlow's words about tf-slim, not a finding here.
@pytest.mark.filterwarnings("ignore:`layer.apply` is deprecated:UserWarning")
@pytest.mark.parametrize("style", list(STYLES))
def test_packed_reads_train_to_stocks_numbers(style, caplog):
  """Stock, ours, ours with the option: one set of numbers, to the bit."""
  if style == "estimator" and ESTIMATOR is None:
    pytest.skip("TensorFlow %s has no tf.compat.v1.estimator (removed in "
                "2.16); CI runs this on 2.15" % tf.__version__)
  want, _ = _train(style, support.STOCK)
  plain, plain_packs = _train(style, support.OURS, pack_variable_reads=False)
  with caplog.at_level(logging.DEBUG,
                       logger="tensorflow." + _rewired_reads.__name__):
    got, packs = _train(style, support.OURS, pack_variable_reads=True)
  assert set(want) == set(plain) == set(got)
  assert len(want) >= 2
  for name, value in want.items():
    np.testing.assert_array_equal(plain[name], value, err_msg=name)
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  assert not plain_packs
  # Every model here has two or more small float variables on a ps task.
  assert packs and all(op.device.startswith("/job:ps/") for op in packs)
  rewired = [r.getMessage() for r in caplog.records
             if "rewired read" in r.getMessage()]
  assert len(rewired) >= 2, caplog.text
  assert any("cross as %d packed reads" % len(packs) in r.getMessage()
             for r in caplog.records), caplog.text


def _report_of(build_model):
  """Builds ``build_model()``'s loss, its gradients, and rewires."""
  with tf.compat.v1.device(_setter()):
    loss = build_model()
    opt = tf.compat.v1.train.GradientDescentOptimizer(LR)
    grads_and_vars = opt.compute_gradients(loss)
    return _rewired_reads.rewire(grads_and_vars, scope="test/"), loss


def test_each_case_is_packed_or_counted(graph):
  ps = lambda task: tf.compat.v1.device("/job:ps/task:%d" % task)

  def model():
    with ps(0):
      a = tf.compat.v1.get_variable("a", [3, 2])
      b = tf.compat.v1.get_variable("b", [4])
      under = tf.compat.v1.get_variable("under", [2])
      big = tf.compat.v1.get_variable(
          "big", [_packing.MAX_PACKED_ELEMENTS + 1])
      in_cond = tf.compat.v1.get_variable("in_cond", [2])
      rows = tf.compat.v1.get_variable("rows", [6, 2])
    with ps(1):
      lone = tf.compat.v1.get_variable("lone", [2], tf.float64)
      parted = tf.compat.v1.get_variable(
          "parted", [4, 2], partitioner=(
              tf.compat.v1.fixed_size_partitioner(2)))
    with tf.control_dependencies([tf.no_op(name="before")]):
      under_read = tf.identity(under.read_value())
    terms = [tf.reduce_sum(tf.sin(a)), tf.reduce_sum(b * b),
             tf.reduce_sum(under_read * 3.0), tf.reduce_sum(big),
             tf.cast(tf.reduce_sum(lone), tf.float32),
             tf.reduce_sum(tf.convert_to_tensor(parted) ** 2),
             tf.reduce_sum(tf.gather(rows, [1, 3])),
             tf.cond(tf.constant(True),
                     lambda: tf.reduce_sum(in_cond.read_value()),
                     lambda: tf.constant(0.0))]
    return tf.add_n(terms)

  report, _ = _report_of(model)
  by_var = {var: consumers for _, var, consumers in report.rewired}
  # a and b (ps 0), the two parts of `parted` (ps 1): one packed read each.
  assert sorted(by_var) == ["a", "b", "parted/part_0", "parted/part_1"]
  assert report.packed_reads == 2
  # The forward op and its gradient op both moved for a, and b's product.
  assert len(by_var["a"]) == 2 and len(by_var["b"]) >= 2, by_var
  left = report.left_plain
  assert left[_rewired_reads.HUGE] >= 1
  assert left[_rewired_reads.ALONE] >= 1  # lone, the only float64.
  assert left[_rewired_reads.CONTROL_DEPENDENCIES] == 1
  assert left[_rewired_reads.CONTROL_FLOW] >= 1
  assert left[_rewired_reads.GATHER] >= 1
  assert _rewired_reads.NOT_FLOAT not in left  # No int variable trained.


@pytest.mark.parametrize("use_resource", [True, False],
                         ids=["resource", "ref"])
def test_a_read_taken_into_v1_control_flow_stays_whole(graph, use_resource):
  """A v1 cond or while_loop reads through Switch and Enter; a read one of
  them takes keeps all its consumers (one value, as before)."""
  was_v2 = tf.compat.v1.control_flow_v2_enabled()
  tf.compat.v1.disable_control_flow_v2()
  try:
    with tf.compat.v1.device(_setter()), tf.compat.v1.variable_scope(
        "", use_resource=use_resource):
      a, b, c, d = [tf.compat.v1.get_variable(n, [2]) for n in "abcd"]
      a_read = tf.convert_to_tensor(a)
      loss = (tf.reduce_sum(a_read * tf.convert_to_tensor(b))
              + tf.reduce_sum(tf.sin(tf.convert_to_tensor(d))))
      loss += tf.cond(tf.constant(True), lambda: tf.reduce_sum(c * 2.0),
                      lambda: tf.reduce_sum(a_read))
      loss += tf.compat.v1.while_loop(
          lambda i, x: i < 3, lambda i, x: (i + 1, x + tf.reduce_sum(c)),
          [0, 0.0])[1]
      opt = tf.compat.v1.train.GradientDescentOptimizer(LR)
      grads_and_vars = opt.compute_gradients(loss, [a, b, c, d])
      edges = [(op, i) for op in a_read.consumers()
               for i, t in enumerate(op.inputs) if t.name == a_read.name]
      report = _rewired_reads.rewire(grads_and_vars, scope="test/")
  finally:
    if was_v2:
      tf.compat.v1.enable_control_flow_v2()
  # The setter put a and c on ps 0, b and d on ps 1: only the reads
  # without a control-flow consumer moved.
  assert sorted(var for _, var, _ in report.rewired) == ["b", "d"], report
  assert report.left_plain[_rewired_reads.CONTROL_FLOW] >= 3
  assert len(edges) >= 3  # The product, its gradient, the Switch.
  assert all(op.inputs[i].name == a_read.name for op, i in edges)


def test_minimize_under_control_dependencies_orders_no_packed_read(graph):
  """The batch-norm recipe, minimize under control_dependencies(update_ops):
  the packed reads must not wait for ops that consume the model's reads (a
  cycle) or for anything else a plain read did not wait for."""
  with tf.compat.v1.device(_setter()):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    loss, _ = _v1_model(True)()
    with tf.compat.v1.device("/job:ps/task:0"):
      seen = tf.compat.v1.get_variable("seen", [], trainable=False)
    update_ops = [tf.compat.v1.assign_add(seen, loss)]
    opt = sync_replicas.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(LR), 1,
        pack_variable_reads=True)
    with tf.control_dependencies(update_ops):
      opt.minimize(loss, global_step=global_step)
  packed = [op for op in graph.get_operations()
            if "/packed_reads/" in op.name]
  assert any(op.type == "ConcatV2" for op in packed)
  assert all(not op.control_inputs for op in packed), [
      (op.name, op.control_inputs) for op in packed if op.control_inputs]


def test_non_float_and_deviceless_variables_stay_plain(graph):
  with tf.compat.v1.device("/job:ps/task:0"):
    counts = [tf.compat.v1.get_variable("n%d" % i, [2], tf.int32)
              for i in range(2)]
  local = [tf.compat.v1.get_variable("l%d" % i, [2]) for i in range(2)]
  with tf.compat.v1.device("/job:worker/task:0"):
    uses = [tf.reduce_sum(tf.convert_to_tensor(v)) for v in counts + local]
  # Given as gradients, as a script handing pairs to apply_gradients could.
  pairs = [(tf.zeros([2], v.dtype.base_dtype), v) for v in counts + local]
  before = len(graph.get_operations())
  report = _rewired_reads.rewire(pairs, scope="test/")
  assert report.rewired == () and report.packed_reads == 0
  assert report.left_plain == {_rewired_reads.NOT_FLOAT: 2,
                               _rewired_reads.NO_DEVICE: 2}
  assert len(graph.get_operations()) == before
  del uses


def test_reads_on_the_variables_task_and_control_inputs_stay(graph):
  """The chief's side reads on the ps: untouched; a control edge stays."""
  with tf.compat.v1.device("/job:ps/task:0"):
    a = tf.compat.v1.get_variable("a", [2])
    b = tf.compat.v1.get_variable("b", [2])
    on_ps = tf.add(a.read_value(), b.read_value(), name="on_ps")
  with tf.compat.v1.device("/job:worker/task:0"):
    a_read = tf.convert_to_tensor(a)
    with tf.control_dependencies([a_read.op]):
      after = tf.no_op(name="after_read")
    loss = tf.reduce_sum(a_read * tf.convert_to_tensor(b))
  ps_inputs = list(on_ps.op.inputs)
  opt = tf.compat.v1.train.GradientDescentOptimizer(LR)
  report = _rewired_reads.rewire(opt.compute_gradients(loss), scope="test/")
  assert report.packed_reads == 1
  assert list(on_ps.op.inputs) == ps_inputs
  assert list(after.control_inputs) == [a_read.op]
  assert all("packed_reads" in t.name for t in loss.op.inputs[0].op.inputs)




def test_one_tensor_crosses_per_ps_task():
  """Traced: 40 variables' forward and gradient reads, 2 transfers."""
  counts = {}
  with SHARED.use() as cluster:
    for packed in (False, True):
      g = tf.Graph()
      with g.as_default(), tf.compat.v1.device(_setter()):
        variables = [tf.compat.v1.get_variable("t%d" % i, [10])
                     for i in range(40)]
        loss = tf.add_n([tf.reduce_sum(tf.sin(v)) for v in variables])
        opt = tf.compat.v1.train.GradientDescentOptimizer(LR)
        grads_and_vars = opt.compute_gradients(loss)
        if packed:
          _rewired_reads.rewire(grads_and_vars, scope="test/")
        fetch = [loss] + [grad for grad, _ in grads_and_vars]
        init = tf.compat.v1.global_variables_initializer()
      counts[packed] = support.traced_worker_recvs(
          cluster.worker_targets[0], g, fetch, init)
  # Measured: 40 and 2 (one per ps task).
  assert counts == {False: 40, True: 2}, counts


def test_the_option_is_off_by_default_and_read_from_the_environment(
    monkeypatch):
  make = lambda **kw: sync_replicas.SyncReplicasOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(LR), 2, **kw)
  monkeypatch.delenv(_rewired_reads.ENV, raising=False)
  assert make().options.pack_variable_reads is False
  assert make(pack_variable_reads=True).options.pack_variable_reads is True
  monkeypatch.setenv(_rewired_reads.ENV, "1")
  assert make().options.pack_variable_reads is True
  assert make(pack_variable_reads=False).options.pack_variable_reads is False
  monkeypatch.setenv(_rewired_reads.ENV, "0")
  assert make().options.pack_variable_reads is False


@pytest.mark.parametrize("value, env, match", [
    ("yes", None, r"pack_variable_reads must be True, False or None.*'yes'"),
    (1, None, r"pack_variable_reads must be True, False or None.*got 1"),
    (None, "maybe", r"SYNC_REPLICAS_PACK_VARIABLE_READS must be 1 or 0.*"
     r"'maybe'.*unset it"),
], ids=["string", "int", "bad-environment"])
def test_bad_values_are_refused_before_any_op(graph, monkeypatch, value, env,
                                              match):
  monkeypatch.delenv(_rewired_reads.ENV, raising=False)
  if env is not None:
    monkeypatch.setenv(_rewired_reads.ENV, env)
  before = len(graph.get_operations())
  with pytest.raises(ValueError, match=match):
    sync_replicas.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(LR), 2,
        pack_variable_reads=value)
  assert len(graph.get_operations()) == before

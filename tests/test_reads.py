"""read_packed: the same values and gradients as plain reads, fewer transfers."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import _packing

# One cluster for the whole file: in-process servers cannot be stopped. The
# reads use fresh variable names; a training run resets the containers.
_CLUSTER = {}


def _cluster():
  if not _CLUSTER:
    _CLUSTER["c"] = sync_replicas.LocalCluster(num_workers=1, num_ps=2)
  return _CLUSTER["c"]


def _model(use_resource, *, scope):
  """Small variables on 2 ps tasks (two dtypes), a large one, a lone one."""
  rng = np.random.default_rng(7)
  init = lambda shape, dtype=np.float32: tf.constant(
      rng.normal(size=shape).astype(dtype))
  with tf.compat.v1.variable_scope(scope, use_resource=use_resource):
    with tf.compat.v1.device("/job:ps/task:0"):
      on_ps0 = [tf.compat.v1.get_variable("a", initializer=init([3, 2])),
                tf.compat.v1.get_variable("b", initializer=init([5])),
                tf.compat.v1.get_variable("c", initializer=init([2, 2, 2])),
                tf.compat.v1.get_variable(
                    "d64", initializer=init([4], np.float64)),
                tf.compat.v1.get_variable(
                    "e64", initializer=init([2], np.float64)),
                tf.compat.v1.get_variable(
                    "big", initializer=init([_packing.MAX_PACKED_ELEMENTS
                                             + 1]))]
    with tf.compat.v1.device("/job:ps/task:1"):
      on_ps1 = [tf.compat.v1.get_variable("f", initializer=init([7])),
                tf.compat.v1.get_variable("g", initializer=init([1, 3])),
                tf.compat.v1.get_variable("lone64", initializer=init(
                    [3], np.float64))]
  return on_ps0 + on_ps1


def _reads(variables, packed):
  """The variables' values, through read_packed or read one by one."""
  if packed:
    return sync_replicas.read_packed(variables)
  return [tf.convert_to_tensor(v) for v in variables]


@contextlib.contextmanager
def _sharded_worker(graph):
  """``graph`` as default, variables over 2 ps tasks, other ops on the worker."""
  # The device function needs graph mode: enter the graph first.
  with graph.as_default(), tf.compat.v1.device(
      tf.compat.v1.train.replica_device_setter(
          ps_tasks=2, worker_device="/job:worker/task:0")):
    yield


def _loss(values):
  # Nonlinear in every value, so each gradient depends on what was read.
  return tf.add_n([tf.cast(tf.reduce_sum(tf.sin(v) * v), tf.float32)
                   for v in values])


@pytest.mark.parametrize("use_resource", [True, False],
                         ids=["resource", "ref"])
def test_values_and_gradients_equal_plain_reads(use_resource):
  cluster = _cluster()
  g = tf.Graph()
  with g.as_default(), tf.compat.v1.device("/job:worker/task:0"):
    variables = _model(use_resource, scope="vg_%s" % use_resource)
    plain = _reads(variables, packed=False)
    packed = _reads(variables, packed=True)
    opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    grads_plain = [gr for gr, _ in opt.compute_gradients(_loss(plain),
                                                         variables)]
    grads_packed = [gr for gr, _ in opt.compute_gradients(_loss(packed),
                                                          variables)]
    init = tf.compat.v1.global_variables_initializer()
  with tf.compat.v1.Session(cluster.worker_targets[0], graph=g,
                            config=support.session_config()) as sess:
    sess.run(init)
    want, got, want_g, got_g = sess.run(
        [plain, packed, grads_plain, grads_packed])
  for v, a, b in zip(variables, want, got, strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape, v.op.name
    np.testing.assert_array_equal(a, b, err_msg=v.op.name)
  for v, a, b in zip(variables, want_g, got_g, strict=True):
    np.testing.assert_array_equal(a, b, err_msg="gradient of " + v.op.name)

  # One concatenation per (ps task, dtype) of two or more small variables,
  # on the ps; its split in the caller's device scope (the worker).
  concats = sorted((op.device, len(op.inputs) - 1) for op in g.get_operations()
                   if op.name.startswith("packed_reads/packed_values")
                   and op.type == "ConcatV2")
  assert concats == [("/job:ps/task:0", 2), ("/job:ps/task:0", 3),
                     ("/job:ps/task:1", 2)]
  splits = [op.device for op in g.get_operations()
            if op.type == "SplitV" and op.name.startswith("packed_reads/")]
  assert splits == ["/job:worker/task:0"] * 3
  # The large variable and the lone float64 one are read as a model would.
  for i in (5, 8):
    assert not packed[i].op.name.startswith("packed_reads/packed"), (
        packed[i].op.name)




def test_one_tensor_crosses_per_ps_task():
  """Traced on a real cluster: 40 variables, 2 transfers instead of 40."""
  cluster = _cluster()
  counts = {}
  for packed in (False, True):
    g = tf.Graph()
    with _sharded_worker(g):
      variables = [tf.compat.v1.get_variable("t%s_%d" % (packed, i), [10])
                   for i in range(40)]
      values = _reads(variables, packed)
      total = tf.add_n([tf.reduce_sum(v) for v in values])
      init = tf.compat.v1.global_variables_initializer()
    counts[packed] = support.traced_worker_recvs(
        cluster.worker_targets[0], g, total, init)
  # Measured: 40 and 2 (one per ps task).
  assert counts == {False: 40, True: 2}, counts


@pytest.mark.parametrize("opt_cls", [support.STOCK, support.OURS],
                         ids=["stock", "ours"])
def test_sync_training_through_packed_reads_equals_plain_reads(opt_cls):
  """Any optimizer, stock's too: packed reads train to the same numbers."""
  cluster = _cluster()
  results = {}
  for packed in (False, True):
    g = tf.Graph()
    with _sharded_worker(g):
      variables = _model(True, scope="m")
      global_step = tf.compat.v1.train.get_or_create_global_step()
      values = _reads(variables, packed)
      # Ours with stock's start: the steps below count its initial token.
      opt = opt_cls(tf.compat.v1.train.AdamOptimizer(0.01),
                    replicas_to_aggregate=1, total_num_replicas=1,
                    **({} if opt_cls is support.STOCK
                       else dict(data_end="stock")))
      train_op = opt.minimize(_loss(values), global_step=global_step)
      hook = opt.make_session_run_hook(True)
    # The previous run closed the token queue, whose shared name is fixed:
    # clear every container of the cluster first.
    tf.compat.v1.Session.reset(cluster.worker_targets[0])
    with g.as_default(), support.monitored_session(
        cluster.worker_targets[0], is_chief=True, hooks=[hook]) as sess:
      # A step returns once its gradient is pushed and the chief's runner
      # applies it after: wait for each update before the next push, so
      # the protocol runs the same way every time. The second push is
      # stale (the initial token carries step 0) and dropped, as in stock.
      for expected in (1, 1, 2, 3, 4):
        sess.run(train_op)
        support.wait_until(lambda e=expected: sess.run(global_step) == e,
                           timeout=20, what="global step %d" % expected)
      results[packed] = sess.run(variables + [global_step])
  assert results[False][-1] == results[True][-1] == 4
  for a, b in zip(results[False], results[True], strict=True):
    np.testing.assert_array_equal(a, b)


def test_bad_input_is_refused_before_any_op(graph):
  with tf.compat.v1.device("/job:ps/task:0"):
    v = tf.compat.v1.get_variable("v", [3])
  before = len(graph.get_operations())
  with pytest.raises(TypeError, match=r"list or tuple of tf.Variable.*"
                     r"read_packed\(\[w, b\]\)"):
    sync_replicas.read_packed(v)
  with pytest.raises(TypeError, match=r"got <tf.Tensor.*at index 1"):
    sync_replicas.read_packed([v, tf.convert_to_tensor(v)])
  other = tf.Graph()
  with other.as_default():
    w = tf.compat.v1.get_variable("w", [3])
  after_tensor = len(graph.get_operations())
  with pytest.raises(ValueError, match=r"'w' at index 1 belongs to another "
                     r"graph.*graph.as_default"):
    sync_replicas.read_packed([v, w])
  assert len(graph.get_operations()) == after_tensor
  assert after_tensor == before + 1  # Only the test's own read above.
  assert sync_replicas.read_packed([]) == []


def test_eager_execution_is_refused():
  # Test functions run eagerly unless they enter a graph (TF2's default).
  assert tf.executing_eagerly()
  v = tf.Variable([1.0, 2.0])
  with pytest.raises(RuntimeError, match=r"eager execution is on.*"
                     r"tf.compat.v1 graph"):
    sync_replicas.read_packed([v, v])

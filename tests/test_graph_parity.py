"""Ours builds stock's graph: every stock (op name, op type, device) is ours too."""

import pytest
import tensorflow as tf

import support
from sync_replicas import _packing

pytestmark = pytest.mark.quick  # In ./tools/test --quick.


def _build(opt_cls, *, use_resource, variable_averages):
  """A dense + sparse model over 2 ps via replica_device_setter."""
  g = tf.Graph()
  with g.as_default():
    setter = tf.compat.v1.train.replica_device_setter(
        ps_tasks=2, worker_device="/job:worker/task:1")
    with tf.compat.v1.device(setter):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      with tf.compat.v1.variable_scope("model", use_resource=use_resource):
        emb = tf.compat.v1.get_variable("emb", [50, 4])
        w = tf.compat.v1.get_variable("w", [4, 3])
        b = tf.compat.v1.get_variable("b", [3],
                                      initializer=tf.zeros_initializer())
        unused = tf.compat.v1.get_variable("unused", [2])
      ids = tf.constant([3, 1, 3])
      h = tf.nn.embedding_lookup(emb, ids)
      loss = tf.reduce_sum(tf.matmul(h, w) + b)
      averages = (dict(variable_averages=tf.train.ExponentialMovingAverage(
          0.9), variables_to_average=[w, b]) if variable_averages else {})
      opt = opt_cls(tf.compat.v1.train.AdamOptimizer(0.1),
                    replicas_to_aggregate=2, total_num_replicas=3, **averages)
      grads = opt.compute_gradients(loss, var_list=[emb, w, b, unused])
      train_op = opt.apply_gradients(grads, global_step=global_step)
      opt.get_init_tokens_op()
  ops = {(op.name, op.type, op.device) for op in g.get_operations()}
  return ops, train_op


@pytest.mark.parametrize("use_resource", [True, False],
                         ids=["resource", "ref"])
@pytest.mark.parametrize("variable_averages", [False, True],
                         ids=["plain", "averages"])
def test_every_stock_op_is_in_our_graph(use_resource, variable_averages):
  stock, stock_train = _build(support.STOCK, use_resource=use_resource,
                              variable_averages=variable_averages)
  ours, ours_train = _build(support.OURS, use_resource=use_resource,
                            variable_averages=variable_averages)
  missing = sorted(stock - ours)
  assert not missing, "stock ops missing from ours:\n%s" % "\n".join(
      map(str, missing[:40]))
  # Our additions live only in the status scope (listed in the README).
  extra = sorted(name for name, _, _ in ours - stock)
  assert extra and all(n.startswith("sync_replicas_status/") for n in extra), (
      extra)
  assert (ours_train.name, ours_train.device) == (stock_train.name,
                                                   stock_train.device)


def test_placement_of_protocol_pieces():
  ops, _ = _build(support.OURS, use_resource=True, variable_averages=False)
  by_name = {name: (kind, device) for name, kind, device in ops}
  # The token queue sits with the global step, the local step on the worker.
  assert by_name["sync_token_q"][1].startswith(by_name["global_step"][1])
  assert by_name["sync_rep_local_step"][1] == "/job:worker/task:1"
  accumulators = {n: (k, d) for n, (k, d) in by_name.items()
                  if k.endswith("ConditionalAccumulator")}
  # One per variable with a gradient (the unused one has None), each on its
  # variable's ps task.
  assert sorted(accumulators) == [
      "sync_replicas/conditional_accumulator",
      "sync_replicas/conditional_accumulator_1",
      "sync_replicas/sparse_conditional_accumulator"]
  assert accumulators["sync_replicas/sparse_conditional_accumulator"] == (
      "SparseConditionalAccumulator", by_name["model/emb"][1])
  assert accumulators["sync_replicas/conditional_accumulator"][1] == (
      by_name["model/w"][1])
  assert accumulators["sync_replicas/conditional_accumulator_1"][1] == (
      by_name["model/b"][1])


def test_fused_mode_builds_one_dense_accumulator_per_ps_task(graph):
  del graph
  with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
      ps_tasks=2, worker_device="/job:worker/task:0")):
    gs = tf.compat.v1.train.get_or_create_global_step()
    dense = [tf.compat.v1.get_variable("v%d" % i, [3, 2]) for i in range(10)]
    emb = tf.compat.v1.get_variable("emb", [20, 2])
    loss = tf.add_n([tf.reduce_sum(v) for v in dense]) + tf.reduce_sum(
        tf.gather(emb, [1, 5]))
    opt = support.OURS(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                       replicas_to_aggregate=2, fuse_dense_gradients=True)
    opt.minimize(loss, global_step=gs)
  kinds = sorted((type(a).__name__, d) for a, d in opt.accumulators)
  # replica_device_setter spreads the 10 dense variables over both tasks.
  assert kinds == [("ConditionalAccumulator", "/job:ps/task:0"),
                   ("ConditionalAccumulator", "/job:ps/task:1"),
                   ("SparseConditionalAccumulator", "/job:ps/task:1")], kinds


def _build_many(opt_cls, **options):
  """12 small dense variables, one large one and a table over 2 ps tasks."""
  g = tf.Graph()
  with g.as_default(), tf.compat.v1.device(
      tf.compat.v1.train.replica_device_setter(
          ps_tasks=2, worker_device="/job:worker/task:0")):
    gs = tf.compat.v1.train.get_or_create_global_step()
    small = [tf.compat.v1.get_variable("v%d" % i, [3, 2] if i % 2 else [5])
             for i in range(12)]
    big = tf.compat.v1.get_variable("big", [_packing.MAX_PACKED_ELEMENTS + 1])
    emb = tf.compat.v1.get_variable("emb", [20, 2])
    loss = (tf.add_n([tf.reduce_sum(v * v) for v in small + [big]])
            + tf.reduce_sum(tf.gather(emb, [1, 5])))
    opt = opt_cls(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                  replicas_to_aggregate=2, **options)
    opt.minimize(loss, global_step=gs)
  return g


def test_packed_transfers_keep_every_stock_op_and_accumulator():
  stock = _build_many(support.STOCK)
  ours = _build_many(support.OURS, pack_gradient_transfers=True)

  def described(g):
    return {(op.name, op.type, op.device) for op in g.get_operations()}

  missing = sorted(described(stock) - described(ours))
  assert not missing, missing[:20]
  extra = sorted(n for n, _, _ in described(ours) - described(stock))
  assert all(n.startswith("sync_replicas_status/") for n in extra), extra
  # Where each stock push takes its gradient from: small ones from a split
  # on their own ps task, the large one and the sparse one straight from
  # the worker's gradient, as in stock.
  sources = {}
  for op in ours.get_operations():
    if op.type == "ResourceAccumulatorApplyGradient" and (
        op.name.startswith("sync_replicas/")):
      source = op.inputs[2].op
      if source.type == "Reshape":
        source = source.inputs[0].op
      sources[op.inputs[0].op.get_attr("shared_name").decode()] = source
  splits = {op.device: op for op in ours.get_operations()
            if op.type == "SplitV"}
  assert sorted(splits) == ["/job:ps/task:0", "/job:ps/task:1"]
  for i in range(12):
    var = ours.get_tensor_by_name("v%d:0" % i)
    source = sources[var.name + "/grad_accum"]
    assert source is splits[var.device], (i, source.name)
  big_source = sources[ours.get_tensor_by_name("big:0").name + "/grad_accum"]
  assert big_source.type != "SplitV"
  assert big_source.device == "/job:worker/task:0"
  for device, split in splits.items():
    concat = split.inputs[0].op
    assert concat.type == "ConcatV2"
    assert concat.device == "/job:worker/task:0"
    sizes = [6 if i % 2 else 5 for i in range(12)
             if ours.get_tensor_by_name("v%d:0" % i).device == device]
    assert concat.outputs[0].shape == [sum(sizes)] and len(sizes) == 6


def test_unpacked_transfers_are_stock_routes():
  """pack_gradient_transfers=False: every push reads the worker's gradient."""
  ours = _build_many(support.OURS, pack_gradient_transfers=False)
  assert not [op for op in ours.get_operations()
              if "packed_transfers" in op.name or op.type == "SplitV"]
  pushes = [op for op in ours.get_operations()
            if op.type == "ResourceAccumulatorApplyGradient"
            and op.name.startswith("sync_replicas/")]
  assert len(pushes) == 13
  assert all(p.inputs[2].op.device == "/job:worker/task:0" for p in pushes)

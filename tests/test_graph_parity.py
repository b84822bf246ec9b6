"""Ours builds stock's graph: every stock op is ours too, wired as stock's.

Each op of stock's graph, built side by side, must exist in ours with the
same name, type and device, the same data inputs (by name, in order) and
at least its control inputs. Ours departs from stock's wiring only where
docs/design.md says it does, each checked as narrowly as it can be here
(``_documented``): the restart generation added to a step, the packed
transfers' route of a small gradient, and ordering added from our own
scope.
"""

import pytest
import tensorflow as tf

import support
from sync_replicas import _packing

pytestmark = pytest.mark.quick  # In ./tools/test --quick.


#: Our own name scope: every op we add lives here.
OWN_SCOPE = "sync_replicas_status/"

#: (op type, data input) where ours gives a stock op a step plus the restart
#: generation (docs/design.md, "One update"; docs/operations.md, restarts):
#: the token enqueues, the local step's init and the accumulators'
#: set-steps.
ENCODED_STEP_INPUTS = {("QueueEnqueueManyV2", 1), ("AssignVariableOp", 1),
                       ("ResourceAccumulatorSetGlobalStep", 1),
                       ("AccumulatorSetGlobalStep", 1)}
#: (op type, data input) where ours gives a stock push its gradient through
#: the packed transfers (docs/options.md, "Packed gradient transfers").
PACKED_GRADIENT_INPUTS = {("ResourceAccumulatorApplyGradient", 2),
                          ("AccumulatorApplyGradient", 2)}


def _is_encoded(stock_input, our_input):
  """``our_input`` is stock's value plus an offset of ours (one AddV2).

  The chief's tokens may first be cut (``data_end``, one Slice of ours): the
  release to the workers not done, the initial ones on the first start.

  Stock's value is the same tensor, or a read of the same variable: the
  chief's set-steps share one read of the global step made after this
  start (``_restart.ChiefStart``), and stock's own read stays, unused.
  """
  add = our_input.op
  if add.type != "AddV2" or not add.inputs[1].name.startswith(OWN_SCOPE):
    return False
  value = add.inputs[0]
  if value.op.type == "Slice" and value.op.name.startswith(
      (OWN_SCOPE + "release_count/", OWN_SCOPE + "initial_count/")):
    # The chief's tokens, cut to the rights to push the workers lack
    # (docs/data_end.md).
    value = value.op.inputs[0]
  return value.name == stock_input.name or (
      value.op.type == stock_input.op.type == "ReadVariableOp"
      and value.op.inputs[0].name == stock_input.op.inputs[0].name)


def _unflat(tensor):
  return tensor.op.inputs[0] if tensor.op.type == "Reshape" else tensor


def _is_packed_part(stock_input, our_input, *, through=0):
  """``our_input`` is the part of a packed transfer that carried stock's.

  Its split (ours, on the ps) cut the worker's concatenation, whose part
  at the same place is stock's gradient (each flattened, reshaped back).
  ``through``: how many ops of ours (Identity) stand between the split and
  the concatenation.
  """
  part = _unflat(our_input)
  split = part.op
  if split.type != "SplitV" or not split.name.startswith(
      OWN_SCOPE + "packed_transfers/"):
    return False
  concat = split.inputs[0].op
  for _ in range(through):
    if concat.type != "Identity":
      return False
    concat = concat.inputs[0].op
  return (concat.type == "ConcatV2"
          and _unflat(concat.inputs[part.value_index]).name
          == stock_input.name)


#: (op type, data input) where ``statistics=True`` gives a stock push its
#: gradient (dense, or a sparse one's values) through ``ordered_grad``: on
#: the ps, after the global step's read that makes a counted drop certain
#: (docs/operations.md, "Sync statistics").
ORDERED_GRADIENT_INPUTS = PACKED_GRADIENT_INPUTS | {
    ("SparseAccumulatorApplyGradient", 3)}
#: (op type, data input) where ``statistics=True`` gives the worker's local
#: step assign its token out of the one tensor that brings the token and the
#: worker's counts back from the ps.
CARRIED_TOKEN_INPUTS = {("AssignVariableOp", 1), ("Assign", 1)}


def _is_ordered(stock_input, our_input):
  """``our_input`` is stock's gradient, or a packed part of it, made to wait
  for the statistics' read (one Identity of ours, ``ordered_grad``)."""
  ordered = our_input.op
  if ordered.type == "Identity" and ordered.name.startswith(
      OWN_SCOPE + "ordered_grad"):
    return ordered.inputs[0].name == stock_input.name
  # A packed part: the split's input is the concatenation, ordered.
  split = _unflat(our_input).op
  return (split.type == "SplitV"
          and split.inputs[0].op.name.startswith(OWN_SCOPE + "ordered_grad")
          and _is_packed_part(stock_input, our_input, through=1))


def _is_carried_token(stock_input, our_input):
  """``our_input`` is stock's token, unstacked on the worker from our
  ``token_and_counts`` (element 0)."""
  unstack = our_input.op
  if unstack.type != "Unpack" or our_input.value_index != 0:
    return False
  carried = unstack.inputs[0].op
  return (carried.type == "Pack"
          and carried.name == OWN_SCOPE + "token_and_counts"
          and carried.inputs[0].name == stock_input.name)


def _documented(op, index, stock_input, our_input, *, statistics=False):
  """Whether ours' ``index``-th input of stock's ``op`` is a documented
  rewiring of stock's ``stock_input``; ``statistics``: also the two that
  ``statistics=True`` makes."""
  if not our_input.name.startswith(OWN_SCOPE):
    return False
  key = (op.type, index)
  if key in ENCODED_STEP_INPUTS and _is_encoded(stock_input, our_input):
    return True
  if key in PACKED_GRADIENT_INPUTS and _is_packed_part(stock_input,
                                                        our_input):
    return True
  if statistics:
    if key in ORDERED_GRADIENT_INPUTS and _is_ordered(stock_input, our_input):
      return True
    if key in CARRIED_TOKEN_INPUTS and _is_carried_token(stock_input,
                                                         our_input):
      return True
  return False


def _rewired(stock, ours, *, statistics=False):
  """Stock ops that ours wires otherwise than stock and than documented.

  Data inputs must be stock's, in order, but for ``_documented`` ones;
  every stock control input must be there, and ours may add only control
  inputs from its own scope (the chief's init orders its set-steps after
  the clearing, its group after the drains and the chief's local step).
  """
  found = []
  for op in stock.get_operations():
    try:
      mine = ours.get_operation_by_name(op.name)
    except KeyError:
      found.append("%s: missing" % op.name)
      continue
    if len(op.inputs) != len(mine.inputs):
      found.append("%s: %d data inputs, stock %d" % (
          op.name, len(mine.inputs), len(op.inputs)))
      continue
    for i, (theirs, our) in enumerate(zip(op.inputs, mine.inputs,
                                                 strict=True)):
      if theirs.name != our.name and not _documented(
          op, i, theirs, our, statistics=statistics):
        found.append("%s (%s) input %d: %s, stock %s" % (
            op.name, op.type, i, our.name, theirs.name))
    theirs = {c.name for c in op.control_inputs}
    our = {c.name for c in mine.control_inputs}
    for name in sorted(theirs - our):
      found.append("%s: control input ^%s missing" % (op.name, name))
    for name in sorted(our - theirs):
      if not name.startswith(OWN_SCOPE):
        found.append("%s: control input ^%s not stock's" % (op.name, name))
  return found


def _build(opt_cls, *, use_resource, variable_averages):
  """``_build_graph``'s ops as (name, type, device), and its train op."""
  g, train_op = _build_graph(opt_cls, use_resource=use_resource,
                             variable_averages=variable_averages)
  return _described(g), train_op


def _build_graph(opt_cls, *, use_resource, variable_averages):
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
  return g, train_op


def _described(g):
  return {(op.name, op.type, op.device) for op in g.get_operations()}


@pytest.mark.parametrize("use_resource", [True, False],
                         ids=["resource", "ref"])
@pytest.mark.parametrize("variable_averages", [False, True],
                         ids=["plain", "averages"])
def test_every_stock_op_is_in_our_graph(use_resource, variable_averages):
  stock_graph, stock_train = _build_graph(
      support.STOCK, use_resource=use_resource,
      variable_averages=variable_averages)
  our_graph, ours_train = _build_graph(
      support.OURS, use_resource=use_resource,
      variable_averages=variable_averages)
  stock, ours = _described(stock_graph), _described(our_graph)
  missing = sorted(stock - ours)
  assert not missing, "stock ops missing from ours:\n%s" % "\n".join(
      map(str, missing[:40]))
  # Our additions live only in the status scope (listed in the README).
  extra = sorted(name for name, _, _ in ours - stock)
  assert extra and all(n.startswith("sync_replicas_status/") for n in extra), (
      extra)
  assert (ours_train.name, ours_train.device) == (stock_train.name,
                                                   stock_train.device)
  rewired = _rewired(stock_graph, our_graph)
  assert not rewired, "stock ops wired otherwise in ours:\n%s" % (
      "\n".join(rewired[:40]))


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
  missing = sorted(_described(stock) - _described(ours))
  assert not missing, missing[:20]
  extra = sorted(n for n, _, _ in _described(ours) - _described(stock))
  assert all(n.startswith("sync_replicas_status/") for n in extra), extra
  rewired = _rewired(stock, ours)
  assert not rewired, "stock ops wired otherwise in ours:\n%s" % (
      "\n".join(rewired[:40]))
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
  rewired = _rewired(_build_many(support.STOCK), ours)
  assert not rewired, "stock ops wired otherwise in ours:\n%s" % (
      "\n".join(rewired[:40]))


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_statistics_rewire_only_the_pushes_gradients_and_the_token(pack):
  """statistics=True: every stock op is there, wired as stock's but for the
  pushes' gradients (ordered after the statistics' read, on the ps) and the
  local step assign's token (carried back with the worker's counts)."""
  stock = _build_many(support.STOCK)
  ours = _build_many(support.OURS, statistics=True,
                     pack_gradient_transfers=pack)
  missing = sorted(_described(stock) - _described(ours))
  assert not missing, missing[:20]
  rewired = _rewired(stock, ours, statistics=True)
  assert not rewired, "stock ops wired otherwise in ours:\n%s" % (
      "\n".join(rewired[:40]))
  # Without the statistics' two allowances, exactly those inputs differ:
  # every push of the model (13 dense, 1 sparse) and the local step assign.
  strict = _rewired(stock, ours)
  assert len(strict) == 15, strict
  assert sum("AccumulatorApplyGradient" in line for line in strict) == 14
  assert sum("token_and_counts" in line or "unstack" in line
             for line in strict) == 1, strict

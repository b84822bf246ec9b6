"""transfer_dtype: float32 crosses in 16 bits, accumulates in float32.

Two workers train one model (float32 variables on two ps tasks, a sparse
table, a float64 variable) in lockstep waves, each wave one update. The
numbers are predicted exactly: every tensor that crosses is rounded as the
wire rounds it (numpy's float16, and bfloat16 rounded here on float32's bits,
both to nearest even; float16 with its power-of-two scale),
everything else is float32
arithmetic in the same order as the ps does it. Each accumulation path
(per-variable, packed, fused, sparse values) and the packed reads are
checked, and each 16-bit result must differ from the float32 one: the test
fails with the casts knocked out.
"""


import numpy as np
import pytest
import tensorflow as tf

import support
from sync_replicas import _transfer

LR = 0.5  # A power of two: the update's product rounds nowhere.
# "big" is over the packing limit (32768 elements): its gradient crosses on
# its own unless fused, its read on its own with transfer_dtype.
DENSE = {"a": ([4], 0), "b": ([3, 2], 0), "c": ([5], 1), "e": ([2, 2], 1),
         "big": ([32769], 1)}
ROWS = [1, 4]  # The sparse table's rows every push carries.
WAVES = 3

_CLUSTER = support.SharedCluster(num_workers=2, num_ps=2)

# Each path's options; which float32 tensors cross together (one scale for
# float16) follows from them: packed and fused both group a task's dense
# gradients.
PATHS = {
    "direct": dict(pack_gradient_transfers=False),
    # The sparse rows cross with the count row appended on the worker.
    "replica_mean": dict(sparse_reduction="replica_mean"),
    "packed": dict(),
    "fused": dict(fuse_dense_gradients=True),
    "packed_reads": dict(pack_variable_reads=True),
    "fused_reads": dict(fuse_dense_gradients=True, pack_variable_reads=True),
}
# What crosses together (one float16 scale): a task's small variables; every
# test value is under 2**15 but the 1e6 one in "a", so fusing "big" with "c"
# and "e" or not makes no difference to the numbers.
GROUPS = [["a", "b"], ["c", "e"], ["big"]]


def _initial():
  rng = np.random.default_rng(5)
  values = {n: (rng.normal(size=s) * 3).astype(np.float32)
            for n, (s, _) in DENSE.items()}
  values["table"] = rng.normal(size=[6, 2]).astype(np.float32)
  values["d64"] = rng.normal(size=[2])
  return values


def _feeds(worker, *, big):
  """What each wave feeds: x for every dense variable, the table's rows."""
  rng = np.random.default_rng(100 + worker)
  waves = []
  for _ in range(WAVES):
    row = {n: (rng.normal(size=s) * 3).astype(np.float32)
           for n, (s, _) in DENSE.items()}
    row["rows"] = (rng.normal(size=[2, 2]) * 3).astype(np.float32)
    row["d64"] = rng.normal(size=[2])
    waves.append(row)
  if big:
    # float16's largest finite value is 65504: this gradient would be inf.
    waves[0]["a"][0] = np.float32(1e6)
  return waves


class _Worker:
  """One worker's graph: loss sum(v*x) + sum(v*v)/2 per dense variable (its
  gradient x + v reads v), a gathered table and a float64 variable."""

  def __init__(self, cluster, task, options, *, replicas=2):
    self.graph = tf.Graph()
    init = _initial()
    with self.graph.as_default():
      with tf.compat.v1.variable_scope("", use_resource=True):
        with tf.compat.v1.device("/job:ps/task:0"):
          self.global_step = tf.compat.v1.get_variable(
              "global_step", [], tf.int64, tf.zeros_initializer(),
              trainable=False)
        self.vars = {}
        for name, (_, ps) in DENSE.items():
          with tf.compat.v1.device("/job:ps/task:%d" % ps):
            self.vars[name] = tf.compat.v1.get_variable(
                name, initializer=tf.constant(init[name]))
        with tf.compat.v1.device("/job:ps/task:0"):
          self.vars["table"] = tf.compat.v1.get_variable(
              "table", initializer=tf.constant(init["table"]))
        with tf.compat.v1.device("/job:ps/task:1"):
          self.vars["d64"] = tf.compat.v1.get_variable(
              "d64", initializer=tf.constant(init["d64"]))
      with tf.compat.v1.device("/job:worker/task:%d" % task):
        self.feeds = {n: tf.compat.v1.placeholder(tf.float32, s)
                      for n, (s, _) in DENSE.items()}
        self.feeds["rows"] = tf.compat.v1.placeholder(tf.float32, [2, 2])
        self.feeds["d64"] = tf.compat.v1.placeholder(tf.float64, [2])
        terms = [tf.reduce_sum(v * self.feeds[n])
                 + 0.5 * tf.reduce_sum(tf.square(v))
                 for n, v in self.vars.items() if n in DENSE]
        loss = (tf.add_n(terms) + tf.reduce_sum(
            tf.gather(self.vars["table"], ROWS) * self.feeds["rows"])
                + tf.cast(tf.reduce_sum(self.vars["d64"] * self.feeds["d64"]),
                          tf.float32))
        self.opt = support.OURS(support.sgd(LR),
                                replicas_to_aggregate=replicas,
                                total_num_replicas=replicas, **options)
        self.train_op = self.opt.minimize(loss, global_step=self.global_step)
        hook = self.opt.make_session_run_hook(task == 0)
      self.session = support.monitored_session(
          cluster.worker_targets[task], is_chief=task == 0, hooks=[hook])

  def step(self, row, **run_kwargs):
    self.session.run(self.train_op,
                     feed_dict={self.feeds[k]: row[k] for k in self.feeds},
                     **run_kwargs)

  def read(self):
    return self.session.run([self.global_step, self.vars])

  def close(self):
    self.session.close()


def _train(options, *, big):
  """Trains WAVES updates; returns the variables after them."""
  feeds = [_feeds(w, big=big) for w in range(2)]
  with _CLUSTER.use() as cluster:
    workers = []
    try:
      for task in range(2):  # The chief first: it initializes.
        workers.append(_Worker(cluster, task, options))
      for wave in range(WAVES):
        support.run_concurrently([(w.step, feeds[i][wave])
                                  for i, w in enumerate(workers)])
        support.wait_until(lambda s=wave + 1: workers[1].read()[0] == s,
                           timeout=30, what="global_step == %d" % (wave + 1))
      return workers[1].read()[1]
    finally:
      support.close_all(workers)


def roundtrip(x, dtype):
  """What a float32 array is once it crossed as ``dtype`` (None: itself)."""
  x = np.asarray(x, np.float32)
  if dtype is None:
    return x
  if dtype == "bfloat16":
    # The top 16 bits of float32, rounded to nearest even on the 16 cut.
    bits = x.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)
  # float16: scaled by 2**-k when the largest magnitude is 2**15 or more.
  biggest = np.max(np.abs(x)) if x.size else np.float32(0)
  _, exponent = np.frexp(biggest)  # biggest = f * 2**exponent, f in [.5, 1)
  k = max(int(exponent) - 15, 0)
  scale = np.float32(2.0 ** k)
  return (x / scale).astype(np.float16).astype(np.float32) * scale


def _crossed(values, dtype, grouped):
  """The dense values after crossing, one scale per group when grouped."""
  out = {}
  for group in (GROUPS if grouped else [[n] for n in DENSE]):
    flat = np.concatenate([values[n].ravel() for n in group])
    flat = roundtrip(flat, dtype)
    for n in group:
      size = values[n].size
      out[n], flat = flat[:size].reshape(values[n].shape), flat[size:]
  return out


def expected(path, dtype, *, big):
  """The variables after WAVES updates, rounded where the wire rounds."""
  state = _initial()
  feeds = [_feeds(w, big=big) for w in range(2)]
  reads = "reads" in path
  for wave in range(WAVES):
    pushed = []
    for w in range(2):
      seen = _crossed(state, dtype, True) if reads else state
      grads = {n: feeds[w][wave][n] + seen[n] for n in DENSE}
      grads = _crossed(grads, dtype, path != "direct")
      grads["table"] = roundtrip(feeds[w][wave]["rows"], dtype)
      grads["d64"] = feeds[w][wave]["d64"]  # float64 crosses as it is.
      pushed.append(grads)
    for n in list(DENSE) + ["d64"]:
      mean = (pushed[0][n] + pushed[1][n]) / 2
      state[n] = state[n] - (LR * mean).astype(state[n].dtype)
    # Row mean (and replica mean: every push has them): both pushes carry
    # the same rows.
    mean = (pushed[0]["table"] + pushed[1]["table"]) / 2
    state["table"][ROWS] = state["table"][ROWS] - LR * mean
  return state


def _assert_equal(got, want, what):
  for name in want:
    np.testing.assert_array_equal(got[name], want[name],
                                  err_msg="%s: %s" % (what, name))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_accumulates_the_rounded_gradients_in_float32(path, dtype):
  got = _train(dict(PATHS[path], transfer_dtype=dtype), big=False)
  _assert_equal(got, expected(path, dtype, big=False), path)
  # Rounded, so not float32's numbers (the dense values and the sparse rows).
  unrounded = expected(path, None, big=False)
  for name in list(DENSE) + ["table"]:
    assert not np.array_equal(got[name], unrounded[name]), name
  np.testing.assert_array_equal(got["d64"], unrounded["d64"])


@pytest.mark.parametrize("path", ["direct", "packed_reads"])
def test_float16_scales_a_gradient_of_a_million_instead_of_overflowing(path):
  got = _train(dict(PATHS[path], transfer_dtype=tf.float16), big=True)
  want = expected(path, "float16", big=True)
  assert all(np.isfinite(v).all() for v in got.values())
  _assert_equal(got, want, path)
  # The million arrived: a moved by LR * 1e6/2, then halved twice (its
  # gradient x + a is about a).
  assert got["a"][0] < -1e5


def test_the_float32_reference_is_what_training_without_the_option_gives():
  """The harness's own check: without the option, float32's numbers."""
  got = _train(PATHS["packed_reads"], big=False)
  _assert_equal(got, expected("packed_reads", None, big=False), "float32")


def _crossing(options):
  """``{(from job, to job, dtype): [source tensor, ...]}``: what one traced
  step of a lone worker sends between tasks (its partition graphs'
  ``_Recv`` nodes)."""
  with _CLUSTER.use() as cluster:
    worker = None
    try:
      worker = _Worker(cluster, 0, options, replicas=1)
      row = _feeds(0, big=False)[0]
      worker.step(row)  # A graph's first run is not a steady step.
      metadata = tf.compat.v1.RunMetadata()
      worker.step(row, options=tf.compat.v1.RunOptions(
          output_partition_graphs=True), run_metadata=metadata)
    finally:
      if worker is not None:
        worker.close()
  job = lambda device: tf.DeviceSpec.from_string(device).job
  crossing = {}
  for graph in metadata.partition_graphs:
    for node in graph.node:
      if node.op != "_Recv":
        continue
      sender = job(node.attr["send_device"].s.decode())
      receiver = job(node.attr["recv_device"].s.decode())
      if sender != receiver:
        dtype = tf.as_dtype(node.attr["tensor_type"].type).name
        crossing.setdefault((sender, receiver, dtype), []).append(
            node.attr["tensor_name"].s.decode())
  return crossing


def _values(crossing, sender):
  """Float tensors ``sender`` sent, by dtype: variable handles (which name
  the variable's dtype in the trace, 8 bytes each) left out."""
  counts = {}
  for (source, _, dtype), names in crossing.items():
    values = [n for n in names if n.rsplit("_", 1)[-1] not in ("table", "d64")
              and not n.endswith("_d64") and not n.endswith("_table")]
    if source == sender and tf.as_dtype(dtype).is_floating and values:
      counts[dtype] = len(values)
  return counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_bytes_that_cross_are_16_bit(dtype):
  """Traced: every float32 push and packed read crosses in 16 bits."""
  off = _crossing(PATHS["packed_reads"])
  on = _crossing(dict(PATHS["packed_reads"], transfer_dtype=dtype))
  # Pushes: two packed groups, the large gradient and the table's rows,
  # then the float64 one.
  assert _values(off, "worker") == {"float32": 4, "float64": 1}, off
  assert _values(on, "worker") == {dtype: 4, "float64": 1}, on
  # Reads: the two packed reads and the large variable's (the table is
  # gathered on the worker, and the float64 variable's value is not needed
  # for its gradient). Off, the large one's two reads (v * x, v * v) are
  # plain; on, one 16-bit read of its own serves both.
  assert _values(off, "ps") == {"float32": 4}, off
  assert _values(on, "ps") == {dtype: 3}, on


def _graph_def(**options):
  graph = tf.Graph()
  with graph.as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      step = tf.compat.v1.train.get_or_create_global_step()
      v = tf.compat.v1.get_variable("v", [3])
      w = tf.compat.v1.get_variable("w", [2])
    with tf.compat.v1.device("/job:worker/task:0"):
      loss = tf.reduce_sum(v * v) + tf.reduce_sum(w)
      support.OURS(support.sgd(), replicas_to_aggregate=2,
                   **options).minimize(loss, global_step=step)
  return graph.as_graph_def()


@pytest.mark.parametrize("off", [tf.float32, "float32"], ids=["dtype", "name"])
def test_float32_or_no_option_builds_the_graph_without_casts(off,
                                                             monkeypatch):
  monkeypatch.delenv(_transfer.ENV, raising=False)
  plain = _graph_def(pack_variable_reads=True)
  assert _graph_def(pack_variable_reads=True, transfer_dtype=off) == plain
  # And the environment's float32 is off too; bfloat16 is not.
  monkeypatch.setenv(_transfer.ENV, "float32")
  assert _graph_def(pack_variable_reads=True) == plain
  monkeypatch.setenv(_transfer.ENV, "bfloat16")
  assert _graph_def(pack_variable_reads=True) != plain


def test_the_environment_turns_it_on_and_an_argument_wins(graph,
                                                          monkeypatch):
  del graph
  make = lambda **kw: support.OURS(support.sgd(), replicas_to_aggregate=2,
                                   **kw).options.transfer_dtype
  monkeypatch.delenv(_transfer.ENV, raising=False)
  assert make() is None
  assert make(transfer_dtype=tf.bfloat16) == tf.bfloat16
  assert make(transfer_dtype="float16") == tf.float16
  monkeypatch.setenv(_transfer.ENV, " BFloat16 ")
  assert make() == tf.bfloat16
  assert make(transfer_dtype=tf.float32) is None
  assert make(transfer_dtype=tf.float16) == tf.float16


@pytest.mark.parametrize("value,environ,match", [
    (tf.float64, None, r"transfer_dtype must be tf.bfloat16, tf.float16, "
     r"tf.float32 \(off\) or None.*got tf.float64"),
    ("half", None, r"transfer_dtype must be .*got 'half'"),
    (16, None, r"transfer_dtype must be .*got 16"),
    (np.float16, None, r"transfer_dtype must be .*float16"),
    (None, "fp16", r"SYNC_REPLICAS_TRANSFER_DTYPE must be bfloat16, float16 "
     r"or float32 \(off\), got 'fp16'"),
], ids=["float64", "bad_name", "int", "numpy_type", "bad_environment"])
def test_bad_values_are_refused_before_any_op(graph, monkeypatch, value,
                                              environ, match):
  monkeypatch.delenv(_transfer.ENV, raising=False)
  if environ is not None:
    monkeypatch.setenv(_transfer.ENV, environ)
  with pytest.raises(ValueError, match=match):
    support.OURS(support.sgd(), replicas_to_aggregate=2,
                 transfer_dtype=value)
  assert not graph.get_operations()


_PRINTS = """print(sorted(op.outputs[0].dtype.name for op in
             tf.compat.v1.get_default_graph().get_operations()
             if "transfer_dtype/encode" in op.name and op.type == "Cast"))
"""


def test_an_unchanged_script_sends_16_bits_from_the_environment(tmp_path):
  """``python -m sync_replicas.patch`` with the two environment variables:
  stock's class, no option in the script, and both the packed push and the
  packed read cross as bfloat16."""
  done = support.run_unchanged_script(
      tmp_path, _PRINTS, env={_transfer.ENV: "bfloat16",
                              "SYNC_REPLICAS_PACK_VARIABLE_READS": "1"})
  # One cast for the packed gradients of w and b, one for their packed read.
  assert done.stdout == "['bfloat16', 'bfloat16']\n", done.stderr[-4000:]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_gradient_of_unknown_shape_crosses_in_16_bits_too(graph, dtype):
  """float16 reshapes on arrival: an unknown shape is read beside the
  gradient (int32), never by a ps op taking the float32 gradient."""
  del graph
  with tf.compat.v1.device("/job:ps/task:0"):
    step = tf.compat.v1.train.get_or_create_global_step()
    var = tf.compat.v1.get_variable(
        "u", initializer=tf.fill(tf.compat.v1.placeholder_with_default(
            [2, 3], [2]), 0.0), validate_shape=False)
  assert var.shape.as_list() == [None, None]
  with tf.compat.v1.device("/job:worker/task:0"):
    grad = tf.compat.v1.placeholder(tf.float32, [None, None])
    support.OURS(support.sgd(), replicas_to_aggregate=1,
                 transfer_dtype=dtype).apply_gradients([(grad, var)],
                                                       global_step=step)
  graph = tf.compat.v1.get_default_graph()
  crossing = {(t.dtype.name, t.op.type) for op in graph.get_operations()
              if op.device.startswith("/job:ps")
              for t in op.inputs if t.op.device.startswith("/job:worker")}
  # Besides: the local step's handle, and float16's shape.
  assert {d for d, _ in crossing} <= {dtype, "int32", "resource"}, crossing
  assert (dtype, "Cast" if dtype == "bfloat16" else "ConcatV2") in crossing
  assert (("int32", "Shape") in crossing) == (dtype == "float16"), crossing

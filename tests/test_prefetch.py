"""prefetch_variable_reads: the next step's variables cross with the token.

* Parity: a model whose gradients depend on its variables (two ps tasks, a
  group of two variables and one alone), trained in test_parity's
  deterministic waves (all workers together, a backup replica, multi-batch
  accumulation) with stock's optimizer and with ours and the option, is at
  the same values to the bit after every wave; and the staleness rule drops
  the same gradients (the global steps are the waves' own).
* The graph: the worker's train op makes two dependent cross-task trips
  instead of three (the longest chain of task changes that ends in it),
  and its forward pass reads no variable of a ps.
* Fallbacks: a new session reads fresh (the local init fills the copies
  after the local step; a worker restarted mid-training on a changed model
  steps from the ps's values, not a stale copy); a read an op outside the
  gradients consumes stays a fresh packed read.
* The option: keyword, environment variable (an unchanged script run by
  ``python -m sync_replicas.patch`` gets it), implies packed reads, bad
  values refused.
"""


import numpy as np
import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import _prefetch
from sync_replicas import _rewired_reads

pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")
LR = 0.25
_CLUSTER = support.SharedCluster(num_workers=3, num_ps=2)

# test_parity's waves: which workers step together, and the global step the
# protocol reaches after each wave.
SYNC_WAVES = [(0, 1)] * 6
SYNC_STEPS = [1, 1, 2, 3, 4, 5]
BACKUP_WAVES = [(0,), (2,), (1,), (0,), (2,),
                (0, 1), (2,), (1, 2), (0,), (0, 2), (1,)]
BACKUP_STEPS = [0, 1, 1, 1, 1, 2, 2, 3, 3, 4, 4]
# One worker aggregating 2 (multi-batch accumulation): test_parity's two
# workers end waves with concurrent pushes, whose sum order is free, and
# gradients from a forward pass (unlike its dyadic table) round by it.
MULTI_WAVES = [(0,)] * 7
MULTI_STEPS = [0, 1, 1, 1, 2, 2, 3]


def _dyadic(rng, shape):
  return rng.integers(-8, 9, size=shape).astype(np.float32) / 8


def _model(worker_id, v_ps=1):
  """A loss whose gradients read every trained variable: w and b share
  ps 0 (one packed read), v is alone on ps ``v_ps``."""
  with tf.compat.v1.device("/job:ps/task:0"):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    w = tf.compat.v1.get_variable("w", initializer=tf.fill([3, 2], 0.25))
    b = tf.compat.v1.get_variable("b", initializer=tf.constant([0.5, -0.5]))
  with tf.compat.v1.device("/job:ps/task:%d" % v_ps):
    v = tf.compat.v1.get_variable("v", initializer=tf.constant([1.0, 2.0]))
  with tf.compat.v1.device("/job:worker/task:%d" % worker_id):
    x = tf.compat.v1.placeholder(tf.float32, [4, 3])
    y = tf.compat.v1.placeholder(tf.float32, [4, 2])
    loss = tf.reduce_mean(tf.square((tf.matmul(x, w) + b) * v - y))
  return global_step, [w, b, v], (x, y), loss


class Worker:
  """One worker's graph and MonitoredSession; its steps feed a fixed table
  of dyadic batches."""

  def __init__(self, opt_cls, cluster, worker_id, *, replicas, total,
               **options):
    rng = np.random.default_rng(100 + worker_id)
    self.table = [(_dyadic(rng, [4, 3]), _dyadic(rng, [4, 2]))
                  for _ in range(20)]
    self.steps_taken = 0
    self.graph = tf.Graph()
    with self.graph.as_default():
      self.global_step, self.variables, self.feeds, loss = _model(worker_id)
      with tf.compat.v1.device("/job:ps/task:0"):
        self.change_w = self.variables[0].assign(tf.fill([3, 2], -0.75))
      if opt_cls is support.OURS:
        # Stock's start (its spare initial tokens make some pushes stale),
        # so that the waves drop what stock drops.
        options = {"data_end": "stock", **options}
      with tf.compat.v1.device("/job:worker/task:%d" % worker_id):
        self.opt = opt_cls(tf.compat.v1.train.GradientDescentOptimizer(LR),
                           replicas_to_aggregate=replicas,
                           total_num_replicas=total, **options)
        self.train_op = self.opt.minimize(loss, global_step=self.global_step)
      hook = self.opt.make_session_run_hook(worker_id == 0)
      self.session = support.monitored_session(
          cluster.worker_targets[worker_id], is_chief=worker_id == 0,
          hooks=[hook])

  def step(self):
    x, y = self.table[self.steps_taken]
    self.steps_taken += 1
    self.session.run(self.train_op,
                     feed_dict={self.feeds[0]: x, self.feeds[1]: y})

  def read(self):
    return self.session.run([self.global_step] + self.variables)

  def close(self):
    self.session.close()


def _run_waves(opt_cls, waves, steps, *, num_workers, replicas, **options):
  with _CLUSTER.use() as cluster:
    workers = []
    try:
      for i in range(num_workers):  # The chief first: it initializes.
        workers.append(Worker(opt_cls, cluster, i, replicas=replicas,
                              total=num_workers, **options))
      observer = workers[-1]
      snapshots = []
      for wave, step in zip(waves, steps, strict=True):
        support.run_concurrently([(workers[w].step,) for w in wave])
        support.wait_until(
            lambda s=step: observer.read()[0] == s, timeout=20,
            what="global_step == %d after wave %r" % (step, wave))
        snapshots.append(observer.read())
      return snapshots, workers
    finally:
      support.close_all(workers)


@pytest.mark.parametrize("waves,steps,num_workers,replicas", [
    (SYNC_WAVES, SYNC_STEPS, 2, 2),
    (BACKUP_WAVES, BACKUP_STEPS, 3, 2),
    (MULTI_WAVES, MULTI_STEPS, 1, 2),
], ids=["sync", "backup", "multi_batch"])
def test_prefetched_reads_train_to_stocks_numbers(waves, steps, num_workers,
                                                  replicas):
  """Every wave ends on stock's values to the bit, and on stock's global
  step: the same gradients were kept and dropped."""
  kwargs = dict(num_workers=num_workers, replicas=replicas)
  stock, _ = _run_waves(support.STOCK, waves, steps, **kwargs)
  ours, workers = _run_waves(support.OURS, waves, steps,
                             prefetch_variable_reads=True, **kwargs)
  assert workers[0].opt.options.prefetch_variable_reads
  assert workers[0].opt.options.pack_variable_reads
  assert len(stock) == len(ours)
  for i, (a, b) in enumerate(zip(stock, ours, strict=True)):
    for j, (x, y) in enumerate(zip(a, b, strict=True)):
      np.testing.assert_array_equal(x, y, err_msg="wave %d, value %d" % (i, j))
  # The model moved: the waves' updates were applied, not only counted.
  assert not np.array_equal(ours[-1][1], np.full([3, 2], 0.25, np.float32))


def _task(device):
  spec = tf.DeviceSpec.from_string(device or "")
  return spec.job, spec.task


def placed(op):
  """``op``'s task as the placer decides it: an op that takes a resource
  runs where the resource lives (a read on the ps, the train op's assign
  on the worker), whatever device scope built it."""
  for t in op.inputs:
    if t.dtype == tf.resource:
      return placed(t.op)
  return _task(op.device)


def trips(fetch):
  """The longest chain of task changes (data or control edges) that ends
  in ``fetch``: the dependent cross-task trips one run of it makes."""
  fetch = getattr(fetch, "op", fetch)  # A resource assign is a variable.
  depth = {}
  order = []
  stack = [(fetch, False)]
  while stack:  # Post-order, without recursion: graphs are deep.
    op, done = stack.pop()
    if done:
      order.append(op)
      continue
    if op in depth:
      continue
    depth[op] = None
    stack.append((op, True))
    for parent in [t.op for t in op.inputs] + list(op.control_inputs):
      if parent not in depth:
        stack.append((parent, False))
  for op in order:
    depth[op] = max(
        [depth[p] + (placed(p) != placed(op))
         for p in [t.op for t in op.inputs] + list(op.control_inputs)],
        default=0)
  return depth[fetch]


def _graph(v_ps=1, **options):
  g = tf.Graph()
  with g.as_default():
    global_step, variables, _, loss = _model(0, v_ps)
    with tf.compat.v1.device("/job:worker/task:0"):
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(LR),
          replicas_to_aggregate=1, **options)
      train_op = opt.minimize(loss, global_step=global_step)
  return g, opt, train_op, variables


def test_a_step_makes_two_dependent_trips_instead_of_three():
  """One ps: read, push, token (3) become push, token and values (2).

  Two ps: the dequeue on ps 0 follows the push to ps 1 (stock's rule: a
  token only after every push landed), and ps 1's read must follow the
  dequeue, so its values make the hop back: 4 either way (docs/options.md).
  """
  for v_ps, want in ((0, (3, 3, 2)), (1, (4, 4, 4))):
    _, _, plain, _ = _graph(v_ps)
    _, _, packed, _ = _graph(v_ps, pack_variable_reads=True)
    _, _, prefetched, _ = _graph(v_ps, prefetch_variable_reads=True)
    assert (trips(plain), trips(packed), trips(prefetched)) == want, v_ps
  g, opt, _, variables = _graph(prefetch_variable_reads=True)
  # The forward pass and the gradients read no ps variable: every read of
  # a trained variable on the worker's side is gone.
  handles = {v.handle.op for v in variables}
  for op in g.get_operations():
    if _task(op.device) == ("worker", 0) and op.type == "ReadVariableOp":
      assert op.inputs[0].op not in handles, op.name
  # The copies are filled after the token, and by the local init.
  refresh = [op for op in g.get_operations()
             if "/prefetch/" in op.name and op.type == "AssignVariableOp"]
  prime = [op for op in g.get_operations()
           if "/prefetch_init/" in op.name and op.type == "AssignVariableOp"]
  assert len(refresh) == len(prime) == 2  # ps 0's pair and v alone.
  assert opt.local_step_init_op.type == "NoOp"  # The group of both.


def _ancestors(op):
  seen, stack = set(), [op]
  while stack:
    op = stack.pop()
    if op not in seen:
      seen.add(op)
      stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
  return seen


def test_reads_outside_the_gradients_stay_fresh():
  """Reads that an op outside the gradients consumes (a summary, say) are
  made fresh, not from the copy: only this train op refreshes the copy."""
  g = tf.Graph()
  with g.as_default():
    global_step, (w, b, v), _, loss = _model(0)
    with tf.compat.v1.device("/job:worker/task:0"):
      outside = tf.add_n([tf.reduce_sum(w), tf.reduce_sum(b),
                          tf.reduce_sum(v)], name="outside")
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(LR),
          replicas_to_aggregate=1, prefetch_variable_reads=True)
      train_op = opt.minimize(loss, global_step=global_step)
  copies = {op for op in g.get_operations() if op.type == "ReadVariableOp"
            and "prefetched_values" in op.inputs[0].op.name}
  # The gradients' reads: ps 0's pair, v alone.
  assert len(copies & _ancestors(train_op.op)) == 2
  assert not copies & _ancestors(outside.op)
  # w's and b's summary reads cross as one fresh packed read; v's, alone
  # on ps 1, as a plain read.
  fresh = [op for op in _ancestors(outside.op) if op.type == "ConcatV2"]
  assert [_task(op.device) for op in fresh] == [("ps", 0)]
  assert any(op.type == "ReadVariableOp" and op.inputs[0] is v.handle
             for op in _ancestors(outside.op))


def test_a_new_session_reads_fresh_values():
  """A restarted worker's first step uses the ps's values: w is changed
  behind the worker's back between its two sessions (as a ps restored from
  a checkpoint would change it), and its next gradient is computed from
  the changed values, not from its first session's copy."""
  # Stock closes its token queue when its chief's session ends, and a
  # worker's restart is ours: the fresh reads compared with are ours
  # without the copies (pack_variable_reads alone).
  fresh = _restart_run(pack_variable_reads=True)
  ours = _restart_run(prefetch_variable_reads=True)
  for a, b in zip(fresh, ours, strict=True):
    np.testing.assert_array_equal(a, b)
  # The update was applied (the fresh run's numbers are not trivially
  # the set value).
  assert not np.array_equal(ours[1], np.full([3, 2], -0.75, np.float32))


def _restart_run(**options):
  """Worker 1 (1 of 2 replicas aggregated, so it trains alone) takes two
  steps, w is set, worker 1 starts a new session and takes one more step
  while the chief's session stays up: the state after it."""
  with _CLUSTER.use() as cluster:
    workers = []
    try:
      for i in range(2):
        workers.append(Worker(support.OURS, cluster, i, replicas=1, total=2,
                              **options))
      chief, worker = workers
      for expected in (1, 1):
        worker.step()
        support.wait_until(lambda e=expected: worker.read()[0] == e,
                           timeout=20, what="global step %d" % expected)
      workers.pop().close()
      chief.session.run(chief.change_w)
      # Restarted: a new graph and session, as a new process builds them,
      # going on with the batches where the first one stopped.
      worker = Worker(support.OURS, cluster, 1, replicas=1, total=2,
                      **options)
      workers.append(worker)
      worker.steps_taken = 2
      worker.step()
      support.wait_until(lambda: worker.read()[0] == 2, timeout=20,
                         what="the new session's update")
      return worker.read()
    finally:
      support.close_all(workers)


def test_option_keyword_environment_and_bad_values(monkeypatch):
  def make(**kwargs):
    return sync_replicas.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(LR),
        replicas_to_aggregate=1, **kwargs)
  monkeypatch.delenv(_prefetch.ENV, raising=False)
  monkeypatch.delenv(_rewired_reads.ENV, raising=False)
  assert make().options.prefetch_variable_reads is False
  on = make(prefetch_variable_reads=True).options
  assert on.prefetch_variable_reads and on.pack_variable_reads
  monkeypatch.setenv(_prefetch.ENV, "1")
  assert make().options.prefetch_variable_reads is True
  assert make().options.pack_variable_reads is True
  assert make(prefetch_variable_reads=False).options == make(
      prefetch_variable_reads=False, pack_variable_reads=False).options
  monkeypatch.setenv(_prefetch.ENV, "nope")
  with pytest.raises(ValueError, match=r"SYNC_REPLICAS_PREFETCH_VARIABLE_"
                     r"READS must be 1 or 0.*'nope'"):
    make()
  monkeypatch.delenv(_prefetch.ENV)
  with pytest.raises(ValueError, match=r"prefetch_variable_reads must be "
                     r"True, False or None.*got 1"):
    make(prefetch_variable_reads=1)
  with pytest.raises(ValueError, match=r"pack_variable_reads=False was "
                     r"passed"):
    make(prefetch_variable_reads=True, pack_variable_reads=False)


_PRINTS = """print(type(opt).__module__,
      [v.op.name for v in tf.compat.v1.local_variables()
       if "prefetched_values" in v.op.name])
"""


def test_an_unchanged_script_prefetches_from_the_environment(tmp_path):
  """``python -m sync_replicas.patch`` with the environment variable alone:
  stock's class in the script, ours built, w's and b's reads in one copy
  filled after the token."""
  done = support.run_unchanged_script(tmp_path, _PRINTS,
                                     env={_prefetch.ENV: "1"},
                                     unset=[_rewired_reads.ENV])
  assert done.stdout == (
      "sync_replicas.optimizer "
      "['sync_replicas_status/packed_reads/prefetched_values']\n"), (
          done.stdout, done.stderr[-4000:])

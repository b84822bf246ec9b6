"""Same numbers as stock: identical scenarios, stock's class and ours.

Every worker feeds gradients from a fixed table of small multiples of 1/8, so
sums are exact whatever order they arrive in and the two runs must agree to
the bit. A scenario is a list of waves: the workers of a wave step
concurrently, and the next wave starts once they all returned and the global
step reached the value the protocol predicts. The waves are chosen so that
which gradients are fresh, and which token each worker takes, does not depend
on thread timing.
"""

import numpy as np
import pytest
import tensorflow as tf

import support

LR = 0.5
DECAY = 0.5  # EMA decay with an exact float32 complement.

OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(LR),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(LR, 0.5),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(LR),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(LR),
    "rmsprop": lambda: tf.compat.v1.train.RMSPropOptimizer(LR),
    "ftrl": lambda: tf.compat.v1.train.FtrlOptimizer(LR),
}

# TensorFlow's own waves: all workers together, every round.
SYNC_WAVES = [(0, 1)] * 6
SYNC_STEPS = [1, 1, 2, 3, 4, 5]
# 3 workers aggregating 2. Set-up as in TensorFlow's test (0 and 2 make the
# first update, then everyone's step-0 gradient is stale), then each cycle two
# workers make an update and the third, now behind, is dropped; the backup
# rotates.
BACKUP_WAVES = [(0,), (2,), (1,), (0,), (2,),
                (0, 1), (2,), (1, 2), (0,), (0, 2), (1,)]
BACKUP_STEPS = [0, 1, 1, 1, 1, 2, 2, 3, 3, 4, 4]
# 2 workers aggregating 4: each delivers two gradients per update.
MULTI_WAVES = [(0,), (0,), (1,), (1,), (0,), (1,), (0,), (1,), (0, 1),
               (0,), (1,), (0, 1)]
MULTI_STEPS = [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 3]


def _dyadic(rng, shape):
  return rng.integers(-8, 9, size=shape).astype(np.float32) / 8


class Worker:
  """One worker's graph and session for the parity model."""

  def __init__(self, opt_cls, cluster, worker_id, *, make_opt, replicas,
               total, use_resource, step_dtype, averages, one_ps=False,
               make_ema=lambda: tf.train.ExponentialMovingAverage(DECAY)):
    self.id = worker_id
    self.graph = tf.Graph()
    self.steps_taken = 0
    rng = np.random.default_rng(1000 + worker_id)
    # The gradient each of this worker's steps will push.
    self.table = [
        {"dense": _dyadic(rng, [4]), "matrix": _dyadic(rng, [3, 2]),
         "rows": np.sort(rng.choice(6, size=2, replace=False)).astype(
             np.int64),
         "row_values": _dyadic(rng, [2, 2])}
        for _ in range(40)]
    with self.graph.as_default():
      with tf.compat.v1.variable_scope("", use_resource=use_resource):
        with tf.compat.v1.device("/job:ps/task:0"):
          self.global_step = tf.compat.v1.get_variable(
              "global_step", [], step_dtype,
              initializer=tf.zeros_initializer(), trainable=False)
          self.dense = tf.compat.v1.get_variable(
              "dense", initializer=tf.constant([1.0, -1.0, 0.5, 2.0]))
          self.table_var = tf.compat.v1.get_variable(
              "table", initializer=tf.ones([6, 2]))
        # one_ps: dense and matrix share a ps task (and a packed transfer).
        with tf.compat.v1.device("/job:ps/task:%d" % (0 if one_ps else 1)):
          self.matrix = tf.compat.v1.get_variable(
              "matrix", initializer=tf.fill([3, 2], 0.25))
          self.frozen = tf.compat.v1.get_variable(
              "frozen", initializer=tf.constant([3.0, 4.0]))
      with tf.compat.v1.device("/job:worker/task:%d" % worker_id):
        self.feeds = {
            "dense": tf.compat.v1.placeholder(tf.float32, [4]),
            "matrix": tf.compat.v1.placeholder(tf.float32, [3, 2]),
            "rows": tf.compat.v1.placeholder(tf.int64, [2]),
            "row_values": tf.compat.v1.placeholder(tf.float32, [2, 2]),
        }
        sparse = tf.IndexedSlices(self.feeds["row_values"],
                                  self.feeds["rows"],
                                  tf.constant([6, 2], tf.int64))
        # Ours with stock's data_end: these waves make stock's start (every
        # worker's second gradient stale) and must drop what stock drops;
        # the default, "train_all", gives no initial tokens to waste
        # (docs/data_end.md; tests/test_data_end_protocol.py).
        kwargs = {} if opt_cls is support.STOCK else dict(data_end="stock")
        if averages:
          self.ema = make_ema()
          kwargs.update(variable_averages=self.ema,
                        variables_to_average=[self.dense, self.matrix])
        self.opt = opt_cls(make_opt(), replicas_to_aggregate=replicas,
                           total_num_replicas=total, **kwargs)
        self.train_op = self.opt.apply_gradients(
            [(self.feeds["dense"], self.dense),
             (self.feeds["matrix"], self.matrix),
             (sparse, self.table_var),
             (None, self.frozen)],
            global_step=self.global_step)
        hook = self.opt.make_session_run_hook(worker_id == 0)
      self.state = [self.global_step, self.dense, self.matrix,
                    self.table_var, self.frozen]
      if averages:
        self.state += [self.ema.average(self.dense),
                       self.ema.average(self.matrix)]
      self.session = support.monitored_session(
          cluster.worker_targets[worker_id], is_chief=worker_id == 0,
          hooks=[hook])

  def step(self):
    row = self.table[self.steps_taken]
    self.steps_taken += 1
    self.session.run(self.train_op,
                     feed_dict={self.feeds[k]: row[k] for k in self.feeds})

  def read(self):
    return self.session.run(self.state)

  def close(self):
    self.session.close()


# One cluster for the file, big enough for every scenario (3 workers, 2 ps):
# a cluster per run held some 14,000 threads by the end of the file.
_CLUSTER = support.SharedCluster(num_workers=3, num_ps=2)


def run_waves(opt_cls, waves, expected_steps, *, num_workers, replicas,
              make_opt=OPTIMIZERS["sgd"], use_resource=True,
              step_dtype=tf.int64, averages=False, one_ps=False):
  """Runs the waves on the reset cluster; returns a state snapshot per wave."""
  with _CLUSTER.use() as cluster:
    workers = []
    try:
      for i in range(num_workers):  # The chief first: it initializes.
        workers.append(Worker(opt_cls, cluster, i, make_opt=make_opt,
                              replicas=replicas, total=num_workers,
                              use_resource=use_resource, step_dtype=step_dtype,
                              averages=averages, one_ps=one_ps))
      observer = workers[-1]
      snapshots = []
      shadows = observer.read()[1:3] if averages else None
      last_step = 0
      for wave, step in zip(waves, expected_steps, strict=True):
        support.run_concurrently([(workers[w].step,) for w in wave])
        support.wait_until(
            lambda s=step: observer.read()[0] == s, timeout=20,
            what="global_step == %d after wave %r" % (step, wave))
        if averages and step != last_step:
          # The chief averages after releasing the tokens: wait for the
          # shadows to take this update (decay 0.5 keeps them exact).
          values = observer.read()[1:3]
          shadows = [sh - (sh - v) * np.float32(1 - DECAY)
                     for sh, v in zip(shadows, values, strict=True)]
          support.wait_until(
              lambda sh=shadows: all(np.array_equal(a, b) for a, b in zip(
                  observer.read()[5:7], sh, strict=True)),
              timeout=20, what="moving averages of update %d" % step)
        last_step = step
        snapshots.append(observer.read())
      return snapshots, workers
    finally:
      support.close_all(workers)


def assert_same_runs(stock, ours):
  assert len(stock) == len(ours)
  for i, (a, b) in enumerate(zip(stock, ours, strict=True)):
    for j, (x, y) in enumerate(zip(a, b, strict=True)):
      np.testing.assert_array_equal(x, y, err_msg="wave %d, value %d" % (i, j))


def _sgd_expected(workers, contributions):
  """Closed-form dense/matrix values after SGD on the given step indices."""
  dense = np.array([1.0, -1.0, 0.5, 2.0], np.float32)
  matrix = np.full([3, 2], 0.25, np.float32)
  for update in contributions:
    dense -= LR * np.mean([workers[w].table[s]["dense"] for w, s in update],
                          axis=0)
    matrix -= LR * np.mean([workers[w].table[s]["matrix"] for w, s in update],
                           axis=0)
  return dense, matrix


def test_sync_rounds_match_stock_and_closed_form():
  stock, _ = run_waves(support.STOCK, SYNC_WAVES, SYNC_STEPS, num_workers=2,
                       replicas=2)
  ours, workers = run_waves(support.OURS, SYNC_WAVES, SYNC_STEPS,
                            num_workers=2, replicas=2)
  assert_same_runs(stock, ours)
  # Round 1 (step 0) counts; round 2 is stale (the initial tokens carried
  # step 0); rounds 3..6 (steps 2..5) each make one update.
  updates = [[(0, 0), (1, 0)]] + [[(0, s), (1, s)] for s in range(2, 6)]
  dense, matrix = _sgd_expected(workers, updates)
  np.testing.assert_allclose(ours[-1][1], dense, rtol=1e-6)
  np.testing.assert_allclose(ours[-1][2], matrix, rtol=1e-6)
  np.testing.assert_array_equal(ours[-1][4], [3.0, 4.0])  # None gradient.


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_wrapped_optimizers_match_stock(name):
  kwargs = dict(num_workers=2, replicas=2, make_opt=OPTIMIZERS[name])
  stock, _ = run_waves(support.STOCK, SYNC_WAVES, SYNC_STEPS, **kwargs)
  ours, _ = run_waves(support.OURS, SYNC_WAVES, SYNC_STEPS, **kwargs)
  assert_same_runs(stock, ours)
  # The sparse table moved only where rows were pushed.
  assert not np.array_equal(ours[-1][3], np.ones([6, 2]))


@pytest.mark.parametrize("use_resource", [True, False],
                         ids=["resource", "ref"])
@pytest.mark.parametrize("step_dtype", [tf.int32, tf.int64],
                         ids=["int32", "int64"])
def test_variable_kinds_and_step_dtypes_match_stock(use_resource, step_dtype):
  kwargs = dict(num_workers=2, replicas=2, use_resource=use_resource,
                step_dtype=step_dtype, make_opt=OPTIMIZERS["momentum"])
  stock, _ = run_waves(support.STOCK, SYNC_WAVES[:4], SYNC_STEPS[:4],
                       **kwargs)
  ours, _ = run_waves(support.OURS, SYNC_WAVES[:4], SYNC_STEPS[:4], **kwargs)
  assert_same_runs(stock, ours)
  assert ours[-1][0].dtype == step_dtype.as_numpy_dtype


def test_backup_replica_is_dropped_like_stock():
  stock, _ = run_waves(support.STOCK, BACKUP_WAVES, BACKUP_STEPS,
                       num_workers=3, replicas=2)
  ours, workers = run_waves(support.OURS, BACKUP_WAVES, BACKUP_STEPS,
                            num_workers=3, replicas=2)
  assert_same_runs(stock, ours)
  # Which gradient made which update: (worker, its step index).
  updates = [[(0, 0), (2, 0)],  # set-up: the step-0 tokens make the rest stale
             [(0, 2), (1, 1)],  # worker 2's step 2 dropped
             [(1, 2), (2, 3)],  # worker 0's step 3 dropped
             [(0, 4), (2, 4)]]  # worker 1's step 3 dropped
  dense, matrix = _sgd_expected(workers, updates)
  np.testing.assert_allclose(ours[-1][1], dense, rtol=1e-6)
  np.testing.assert_allclose(ours[-1][2], matrix, rtol=1e-6)


def test_multi_batch_mode_matches_stock():
  stock, _ = run_waves(support.STOCK, MULTI_WAVES, MULTI_STEPS,
                       num_workers=2, replicas=4)
  ours, workers = run_waves(support.OURS, MULTI_WAVES, MULTI_STEPS,
                            num_workers=2, replicas=4)
  assert_same_runs(stock, ours)
  updates = [[(0, 0), (0, 1), (1, 0), (1, 1)],
             # steps 2 of each worker were stale (tokens from step 0)
             [(0, 3), (1, 3), (0, 4), (1, 4)],
             [(0, 5), (1, 5), (0, 6), (1, 6)]]
  dense, matrix = _sgd_expected(workers, updates)
  np.testing.assert_allclose(ours[-1][1], dense, rtol=1e-6)
  np.testing.assert_allclose(ours[-1][2], matrix, rtol=1e-6)


def test_variable_averages_applied_by_chief_like_stock():
  # run_waves itself waits for the shadows to equal the closed-form average
  # after every update, so a wrong or missing average times out there.
  kwargs = dict(num_workers=2, replicas=2, averages=True)
  stock, _ = run_waves(support.STOCK, SYNC_WAVES[:4], SYNC_STEPS[:4],
                       **kwargs)
  ours, _ = run_waves(support.OURS, SYNC_WAVES[:4], SYNC_STEPS[:4], **kwargs)
  assert_same_runs(stock, ours)
  assert not np.array_equal(ours[-1][5], [1.0, -1.0, 0.5, 2.0])


@pytest.mark.parametrize("waves,steps,workers,replicas", [
    (SYNC_WAVES, SYNC_STEPS, 2, 2),
    (BACKUP_WAVES, BACKUP_STEPS, 3, 2),
], ids=["sync", "backup"])
def test_fused_dense_gradients_match_stock(waves, steps, workers, replicas):
  """One accumulator per ps task for dense gradients: stock's numbers."""

  def fused(*args, **kwargs):
    return support.OURS(*args, fuse_dense_gradients=True, **kwargs)

  kwargs = dict(num_workers=workers, replicas=replicas,
                make_opt=OPTIMIZERS["adam"])
  stock, _ = run_waves(support.STOCK, waves, steps, **kwargs)
  ours, workers_built = run_waves(fused, waves, steps, **kwargs)
  assert_same_runs(stock, ours)
  # dense (ps 0) and matrix (ps 1) each went through a fused accumulator;
  # the sparse table kept its own.
  kinds = sorted((type(a).__name__, d) for a, d in
                 workers_built[0].opt.accumulators)
  assert kinds == [("ConditionalAccumulator", "/job:ps/task:0"),
                   ("ConditionalAccumulator", "/job:ps/task:1"),
                   ("SparseConditionalAccumulator", "/job:ps/task:0")]


@pytest.mark.parametrize("waves,steps,workers,replicas", [
    (SYNC_WAVES, SYNC_STEPS, 2, 2),
    (BACKUP_WAVES, BACKUP_STEPS, 3, 2),
    (MULTI_WAVES, MULTI_STEPS, 2, 4),
], ids=["sync", "backup", "multi_batch"])
def test_packed_transfers_match_stock(waves, steps, workers, replicas):
  """One transfer per ps task into stock's own accumulators: stock's numbers."""

  def packed(*args, **kwargs):
    return support.OURS(*args, pack_gradient_transfers=True, **kwargs)

  kwargs = dict(num_workers=workers, replicas=replicas, one_ps=True,
                make_opt=OPTIMIZERS["adam"])
  stock, stock_workers = run_waves(support.STOCK, waves, steps, **kwargs)
  ours, ours_workers = run_waves(packed, waves, steps, **kwargs)
  assert_same_runs(stock, ours)
  # Stock's accumulators, one per variable, fed by one split on the ps of
  # one concatenation on the worker.
  graphs = [w[0].graph for w in (stock_workers, ours_workers)]
  accums = [sorted((op.get_attr("shared_name"), op.device)
                   for op in g.get_operations()
                   if "ConditionalAccumulator" in op.type) for g in graphs]
  assert accums[0] == accums[1] and len(accums[1]) == 3
  ops = {op.name: op for op in graphs[1].get_operations()}
  split = ops["sync_replicas_status/packed_transfers/unpacked_gradients"]
  concat = ops["sync_replicas_status/packed_transfers/packed_gradients"]
  assert split.device == "/job:ps/task:0"
  assert concat.device == "/job:worker/task:0"
  assert concat.outputs[0].shape == [4 + 6]
  # (The status scope's own applies are the restart drain's zero pushes.)
  pushed = [op.inputs[2].op for op in graphs[1].get_operations()
            if op.type == "ResourceAccumulatorApplyGradient"
            and not op.name.startswith("sync_replicas_status/")]
  assert len(pushed) == 2 and all(
      p is split or p.inputs[0].op is split for p in pushed), pushed


class _GatedAverage(tf.train.ExponentialMovingAverage):
  """An EMA whose update first enqueues into ``reached`` (the chief got to
  the averages) and then waits for an element of ``gate`` (the test lets it
  go): the window between the averages and the tokens, held open."""

  def __init__(self, decay):
    super().__init__(decay)
    self.queues = _averages_queues()

  def apply(self, var_list=None):
    reached, gate = self.queues
    with tf.control_dependencies([reached.enqueue(1)]):
      with tf.control_dependencies([gate.dequeue()]):
        return super().apply(var_list)


def _averages_queues():
  """(reached, gate) on ps 0, shared by name with every graph making them."""
  with tf.compat.v1.device("/job:ps/task:0"):
    return tuple(tf.queue.FIFOQueue(-1, tf.int32, shapes=[()],
                                    shared_name="test_averages_" + name,
                                    name="test_averages_" + name)
                 for name in ("reached", "gate"))


#: With a backup's worth of tokens (3 per update for 2 workers) one token is
#: left after every update: at the chief's averages it shows whether the
#: tokens of that update went out before them.
ABT_TOTAL = 3
#: The waves and the update each one makes (None: its pushes are stale, as
#: every worker's second push is: the initial tokens carried step 0).
ABT_UPDATES = [1, None, 2, 3]


def test_averages_before_tokens_are_current_when_a_worker_resumes():
  """With averages_before_tokens, no wait: the token implies the average.

  The chief's averages wait for the test (``_GatedAverage``), so stock's
  order, tokens first, cannot hide behind a fast chief: the test looks at
  the token queue while the chief holds at the averages.
  """

  def averaged_first(*args, **kwargs):
    return support.OURS(*args, averages_before_tokens=True, **kwargs)

  with _CLUSTER.use() as cluster:
    workers = []
    probe = tf.Graph()
    with probe.as_default():
      reached, gate = _averages_queues()
      with tf.compat.v1.device("/job:ps/task:0"):
        tokens = tf.queue.FIFOQueue(-1, tf.int64, shapes=[()],
                                    shared_name="sync_token_q")
      reads = dict(reached=reached.size(), tokens=tokens.size())
      let_go, drain = gate.enqueue(1), tokens.dequeue()
    probe_sess = tf.compat.v1.Session(cluster.worker_targets[0], graph=probe,
                                      config=support.session_config())
    try:
      for i in range(2):
        workers.append(Worker(averaged_first, cluster, i,
                              make_opt=OPTIMIZERS["sgd"], replicas=2,
                              total=ABT_TOTAL, use_resource=True,
                              step_dtype=tf.int64, averages=True,
                              make_ema=lambda: _GatedAverage(DECAY)))
      observer = workers[1]
      shadows = observer.read()[5:7]
      for wave, update in enumerate(ABT_UPDATES):
        steps = [support.BoundedThread(w.step, name="worker%d-wave%d" % (w.id,
                                                                         wave))
                 for w in workers]
        for t in steps:
          t.start()
        if wave == 0:
          # The initial tokens let both return before any update.
          for t in steps:
            t.finish()
        if update is not None:
          support.wait_until(
              lambda u=update: probe_sess.run(reads["reached"]) == u,
              timeout=20,
              what="the chief at the averages of update %d" % update)
          queued = probe_sess.run(reads["tokens"])
          assert queued == 0, (
              "update %d: %d tokens went out before the chief's averages"
              % (update, queued))
          probe_sess.run(let_go)
        for t in steps:
          t.finish()
        if wave == 0:
          # Nobody waits for these tokens: that they are out says the
          # averages are done.
          support.wait_until(
              lambda: probe_sess.run(reads["tokens"]) == ABT_TOTAL,
              timeout=20, what="update 1's tokens")
        state = observer.read()
        assert state[0] == max(u or 0 for u in ABT_UPDATES[:wave + 1])
        if update is not None:
          # Every worker returned holding a token of this update (or, after
          # wave 0, the tokens are out), so its average must already be
          # there: read without waiting.
          shadows = [sh - (sh - v) * np.float32(1 - DECAY)
                     for sh, v in zip(shadows, state[1:3], strict=True)]
        np.testing.assert_array_equal(state[5], shadows[0],
                                      err_msg="wave %d" % wave)
        np.testing.assert_array_equal(state[6], shadows[1],
                                      err_msg="wave %d" % wave)
        if wave > 0:
          # The backup's token, left by the two workers: gone before the next
          # update, so that the next check sees only that update's tokens.
          assert probe_sess.run(reads["tokens"]) == 1
          probe_sess.run(drain)
    finally:
      support.close_all(workers)
      probe_sess.close()

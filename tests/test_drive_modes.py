"""Every way real scripts drive stock's protocol gives stock's numbers with ours.

Users start the protocol in many ways: the hook in a MonitoredTrainingSession,
a Supervisor with TF 0.12's recipe (``chief_init_op`` as its local init) or
with its default local init (``chief_init_op`` never runs, as in
tensorflow/models' Inception script), a plain Session with the initializers,
the init tokens and the queue runner started by hand, a Scaffold with its own
``local_init_op``, ``tf_slim.learning.train``. Each addition of ours that is
on by default must behave as stock when what it relies on is absent (issue
16: without ``chief_init_op`` the restart generation read -1, every token
carried ``step - 2**32`` and training stalled after the first update).

Here each mode runs stock's class and ours on the same schedule (both workers
step together, round after round, so which gradients are fresh does not
depend on thread timing) and the variables must agree to the bit, with int32
and int64 global steps.
"""

import gc
import logging

import numpy as np
import pytest
import tensorflow as tf

import support

RUN_OPTIONS = tf.compat.v1.RunOptions(timeout_in_ms=support.OP_TIMEOUT_MS)


@pytest.mark.parametrize("dtype", [tf.int64, tf.int32], ids=["int64", "int32"])
def test_plain_session_without_chief_init_op_trains_as_stock(impl, dtype):
  """The reproduction of issue 16, verbatim but for the step's dtype.

  ``chief_init_op`` is never run (Supervisor's defaults do the same): stock's
  global step goes 1, 1, 2, 3 and its local step 0, 1, 2, 3.
  """
  server = tf.distribute.Server.create_local_server()
  with tf.Graph().as_default() as graph:
    if dtype == tf.int64:
      global_step = tf.compat.v1.train.get_or_create_global_step()
    else:
      global_step = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False,
                                          name="global_step")
    v = tf.compat.v1.Variable([1.0, 2.0])
    # Ours with stock's start: the steps below count its spare token.
    opt = impl(tf.compat.v1.train.GradientDescentOptimizer(0.1),
               replicas_to_aggregate=1, total_num_replicas=1,
               **({} if impl is support.STOCK else dict(data_end="stock")))
    train_op = opt.minimize(tf.reduce_sum(v * v), global_step=global_step)
    init_tokens = opt.get_init_tokens_op()
    local_step = support.local_step_variable(graph)
    coord = tf.compat.v1.train.Coordinator()
    with tf.compat.v1.Session(server.target,
                              config=support.session_config()) as sess:
      sess.run([tf.compat.v1.global_variables_initializer(),
                tf.compat.v1.local_variables_initializer()])
      sess.run(init_tokens)
      threads = opt.get_chief_queue_runner().create_threads(
          sess, coord=coord, daemon=True, start=True)
      seen = []
      for want in [1, 1, 2, 3]:
        sess.run(train_op, options=RUN_OPTIONS)
        # The update a push triggers may land just after the run returns.
        support.wait_until(lambda: sess.run(global_step) >= want, timeout=30,
                           what="global step %d" % want)
        seen.append(tuple(sess.run([global_step, local_step])))
      values = sess.run(v)
      if impl is support.STOCK:
        support.wait_for_stock_runner_to_block(threads)
      coord.request_stop()
      if impl is support.STOCK:
        # Stock's runner thread stays blocked in take_grad: the join waits
        # the whole grace period, then raises.
        with pytest.raises(RuntimeError, match="threads still running"):
          coord.join(threads, stop_grace_period_secs=1)
      else:
        coord.join(threads, stop_grace_period_secs=10)
  assert seen == [(1, 0), (1, 1), (2, 2), (3, 3)]
  expected = np.array([1.0, 2.0], np.float32)
  for _ in range(3):  # SGD on sum(v * v): v - 0.1 * (v + v), in float32.
    expected = expected - np.float32(0.1) * (expected + expected)
  np.testing.assert_array_equal(values, expected)


# ------------------------------------------------------------------ the matrix

#: Both workers step together; round 2's gradients are stale (the initial
#: tokens carried step 0), so 6 rounds make 5 updates.
ROUNDS = 6
STEPS_AFTER_ROUND = [1, 1, 2, 3, 4, 5]
#: Stock's chief cannot stop its blocked runner thread: closing it waits this.
GRACE_SECS = 1
#: One cluster for every run of the matrix, its containers reset before each
#: (a cluster per run held about 9,000 threads by the end of the file).
SHARED = support.SharedCluster(num_workers=2, num_ps=1)


class _Worker:
  """One worker's graph: ``y = x . w`` by SGD, variables on the ps."""

  def __init__(self, opt_cls, target, task, *, step_dtype, opt_kwargs=None):
    self.task = task
    self.is_chief = task == 0
    self.target = target
    self.graph = tf.Graph()
    rng = np.random.default_rng(7 + task)
    # Multiples of 1/8: every sum and mean of two gradients is exact.
    xs = rng.integers(-8, 9, size=(8, 4)).astype(np.float32) / 8
    ys = xs @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    with self.graph.as_default(), tf.compat.v1.device(
        tf.compat.v1.train.replica_device_setter(
            ps_tasks=1, worker_device="/job:worker/task:%d" % task)):
      if step_dtype == tf.int64:
        self.global_step = tf.compat.v1.train.get_or_create_global_step()
      else:
        self.global_step = tf.compat.v1.Variable(
            0, dtype=tf.int32, trainable=False, name="global_step",
            collections=[tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                         tf.compat.v1.GraphKeys.GLOBAL_STEP])
      self.w = tf.compat.v1.get_variable(
          "w", [4], initializer=tf.zeros_initializer())
      loss = tf.reduce_sum(tf.square(
          tf.linalg.matvec(tf.constant(xs), self.w) - ys)) / 8
      opt_kwargs = dict(opt_kwargs or {})
      if opt_cls is not support.STOCK:
        # Every mode replays stock's start (round 2 stale, from the spare
        # initial tokens): ours as stock there (docs/data_end.md).
        opt_kwargs.setdefault("data_end", "stock")
      self.opt = opt_cls(tf.compat.v1.train.GradientDescentOptimizer(0.125),
                         replicas_to_aggregate=2, total_num_replicas=2,
                         **opt_kwargs)
      self.train_op = self.opt.minimize(loss, global_step=self.global_step)
      self.local_step = support.local_step_variable(self.graph)
      self.init_tokens = (self.opt.get_init_tokens_op() if self.is_chief
                          else None)
      self.init_op = tf.compat.v1.global_variables_initializer()
      self.local_init = tf.compat.v1.local_variables_initializer()
      # No readiness op here: only the plain session's non-chief runs one,
      # and TensorFlow logs an "Object was never used" ERROR for each
      # report_uninitialized_variables result that is collected unrun.


class _Session:
  """A started worker session: ``sess`` runs ops, ``close()`` ends it all;
  ``threads``, the chief's queue-runner threads where the mode starts them
  itself (a MonitoredSession's hook keeps its own)."""

  def __init__(self, sess, close, threads=()):
    self.sess = sess
    self.close = close
    self.threads = list(threads)


def _mts_hook(worker):
  """MonitoredTrainingSession with the optimizer's hook (chief, non-chief)."""
  with worker.graph.as_default():
    hook = worker.opt.make_session_run_hook(worker.is_chief)
    sess = support.monitored_session(worker.target, is_chief=worker.is_chief,
                                     hooks=[hook],
                                     stop_grace_period_secs=GRACE_SECS)
  return _Session(sess, sess.close)


def _scaffold(worker):
  """A Scaffold with a local_init_op of its own, and the hook."""
  with worker.graph.as_default():
    mine = tf.compat.v1.Variable(0, trainable=False, name="mine",
                                 collections=[])
    scaffold = tf.compat.v1.train.Scaffold(local_init_op=tf.group(
        tf.compat.v1.local_variables_initializer(), mine.initializer))
    hook = worker.opt.make_session_run_hook(worker.is_chief)
    sess = support.monitored_session(worker.target, is_chief=worker.is_chief,
                                     hooks=[hook], scaffold=scaffold,
                                     stop_grace_period_secs=GRACE_SECS)
  return _Session(sess, sess.close)


def _supervisor(worker, *, recipe_012):
  """A Supervisor, with TF 0.12's recipe or with its default local init.

  The 0.12 recipe makes ``chief_init_op`` (or ``local_step_init_op``) the
  local init op; the default one (tensorflow/models' Inception script)
  initializes local variables only, so ``chief_init_op`` never runs.
  """
  opt = worker.opt
  with worker.graph.as_default():
    kwargs = {}
    if recipe_012:
      kwargs = dict(local_init_op=(opt.chief_init_op if worker.is_chief
                                   else opt.local_step_init_op),
                    ready_for_local_init_op=opt.ready_for_local_init_op)
    sv = tf.compat.v1.train.Supervisor(
        is_chief=worker.is_chief, logdir=None, init_op=worker.init_op,
        recovery_wait_secs=0.2, global_step=worker.global_step,
        save_model_secs=0, save_summaries_secs=0, stop_grace_secs=GRACE_SECS,
        **kwargs)
    sess = sv.prepare_or_wait_for_session(
        worker.target, config=support.session_config(), max_wait_secs=30)
    threads = []
    if worker.is_chief:
      # Both scripts start the runners first, then add the tokens.
      threads = sv.start_queue_runners(sess, [opt.get_chief_queue_runner()])
      sess.run(worker.init_tokens)

  def close():
    try:
      sv.stop()
    finally:
      sess.close()
  return _Session(sess, close, threads)


def _plain_session(worker, *, tokens_first=False, init_ops=True):
  """A plain Session with everything run by hand, chief_init_op included.

  ``tokens_first`` runs the init tokens before ``chief_init_op``: an order
  stock allows (its chief_init_op never touches the token queue). Without
  ``init_ops``, neither ``chief_init_op`` nor ``local_step_init_op`` runs,
  only the variables' initializers (issue 16's reproduction, two workers).
  """
  opt = worker.opt
  sess = tf.compat.v1.Session(worker.target, graph=worker.graph,
                              config=support.session_config())
  coord = tf.compat.v1.train.Coordinator()
  threads = []
  if worker.is_chief:
    sess.run([worker.init_op, worker.local_init])
    if tokens_first:
      sess.run(worker.init_tokens)
    if init_ops:
      sess.run(opt.chief_init_op)
    if not tokens_first:
      sess.run(worker.init_tokens)
    threads = opt.get_chief_queue_runner().create_threads(
        sess, coord=coord, daemon=True, start=True)
  else:
    with worker.graph.as_default():
      uninitialized = tf.compat.v1.report_uninitialized_variables(
          tf.compat.v1.global_variables())
    support.wait_until(lambda: not sess.run(uninitialized).size,
                       timeout=30, what="the chief's initialization")
    sess.run([worker.local_init] + ([opt.local_step_init_op] if init_ops
                                    else []))

  def close():
    coord.request_stop()
    try:
      coord.join(threads, stop_grace_period_secs=GRACE_SECS)
    finally:
      sess.close()
  return _Session(sess, close, threads)


MODES = {
    "monitored_session_hook": _mts_hook,
    "scaffold_local_init_op": _scaffold,
    "supervisor_tf012_recipe": lambda w: _supervisor(w, recipe_012=True),
    "supervisor_default_local_init": (
        lambda w: _supervisor(w, recipe_012=False)),
    "plain_session_by_hand": _plain_session,
    "plain_session_tokens_before_chief_init": (
        lambda w: _plain_session(w, tokens_first=True)),
    "plain_session_without_init_ops": (
        lambda w: _plain_session(w, init_ops=False)),
}


#: The modes whose close joins stock's runner thread and raises when it
#: outlives the grace period.
STOCK_CLOSE_RAISES = {
    "supervisor_tf012_recipe", "supervisor_default_local_init",
    "plain_session_by_hand", "plain_session_tokens_before_chief_init",
    "plain_session_without_init_ops"}


def _train(opt_cls, mode, step_dtype, opt_kwargs=None, statistics=None):
  """Runs ROUNDS rounds in ``mode``; returns (steps, local steps, w, close error).

  The close error is what closing the chief raised (stock's runner thread
  outlives the grace period in several modes), or None. A ``statistics``
  list gets each worker's statistics (``opt.statistics_tensors``), read on
  its own session once the chief counted the last update.
  """
  # Reset also ends a stock runner thread still blocked from the last run.
  with SHARED.use() as cluster:
    workers = [_Worker(opt_cls, cluster.worker_targets[t], t,
                       step_dtype=step_dtype, opt_kwargs=opt_kwargs)
               for t in range(2)]
    # The chief first, so the other finds the model initialized.
    sessions = []
    close_error = None
    try:
      for w in workers:
        sessions.append(MODES[mode](w))
      chief = sessions[0].sess
      steps = []
      for want in STEPS_AFTER_ROUND:
        support.run_concurrently([(s.sess.run, w.train_op)
                                  for w, s in zip(workers, sessions,
                                                  strict=True)])
        support.wait_until(lambda: chief.run(workers[0].global_step) >= want,
                           timeout=30, what="global step %d" % want)
        steps.append(int(chief.run(workers[0].global_step)))
      local_steps = [int(s.sess.run(w.local_step))
                     for w, s in zip(workers, sessions, strict=True)]
      values = chief.run(workers[0].w)
      if statistics is not None:
        # The update is counted after its tokens went out (the sync op, then
        # the count), so the last count may land after the runs returned.
        updates = workers[0].opt.statistics_tensors["chief/updates_applied"]
        support.wait_until(lambda: chief.run(updates) == STEPS_AFTER_ROUND[-1],
                           timeout=30, what="the last update counted")
        statistics.extend(s.sess.run(w.opt.statistics_tensors)
                          for w, s in zip(workers, sessions, strict=True))
      if opt_cls is support.STOCK and sessions[0].threads:
        # Stock's close fails only if its runner is blocked in a take; it may
        # still be between two runs, and then it ends at the stop request.
        support.wait_for_stock_runner_to_block(sessions[0].threads)
    finally:
      # Non-chief first: the chief's runner is the last to need the ps.
      for s in reversed(sessions):
        try:
          s.close()
        except RuntimeError as e:
          close_error = e
  return steps, local_steps, values, close_error


@pytest.mark.parametrize("step_dtype", [tf.int64, tf.int32],
                         ids=["int64", "int32"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_drive_mode_gives_stocks_numbers(mode, step_dtype):
  stock = _train(support.STOCK, mode, step_dtype)
  ours = _train(support.OURS, mode, step_dtype)
  assert ours[0] == stock[0] == STEPS_AFTER_ROUND
  assert ours[1] == stock[1] == [ROUNDS - 1, ROUNDS - 1]
  np.testing.assert_array_equal(ours[2], stock[2])
  assert not np.array_equal(ours[2], np.zeros(4, np.float32))
  # Ours closes cleanly in every mode. Stock's runner thread outlives the
  # grace period in every mode; where the mode joins it without
  # ignore_live_threads (Supervisor.stop, Coordinator.join by hand) the close
  # raises, and a MonitoredSession logs it and returns.
  assert ours[3] is None, ours[3]
  if mode in STOCK_CLOSE_RAISES:
    assert "threads still running" in str(stock[3]), stock[3]
  else:
    assert stock[3] is None, stock[3]


def _num_accumulated(graph):
  """Ops reading how many gradients each accumulator of ``graph`` holds."""
  counts = []
  with graph.as_default():
    for op in graph.get_operations():
      if op.type == "ResourceConditionalAccumulator":
        counts.append(tf.raw_ops.ResourceAccumulatorNumAccumulated(
            handle=op.outputs[0]))
      elif op.type == "ConditionalAccumulator":
        counts.append(tf.raw_ops.AccumulatorNumAccumulated(
            handle=op.outputs[0]))
  assert counts, "no accumulator in the graph"
  return counts


#: After the chief's lone push, then after each round of both workers: the
#: first round's pushes carry the init tokens' step 0 and are stale.
EARLY_PUSH_STEPS = [1, 1, 2, 3, 4]


def _train_with_an_early_push(opt_cls, step_dtype):
  """The non-chief pushes before the chief runs ``chief_init_op``.

  A real window: with the hook, a non-chief starts once the variables are
  initialized, and the chief runs ``chief_init_op`` only after that (in
  ``after_create_session``). The early push is at step 0, fresh; then the
  chief inits, adds the init tokens (the non-chief's blocked dequeue takes
  one) and pushes alone, which makes update 1 out of the two pushes; then
  both step together. Returns (steps, local steps, w).
  """
  with SHARED.use() as cluster:
    chief, other = [_Worker(opt_cls, cluster.worker_targets[t], t,
                            step_dtype=step_dtype) for t in range(2)]
    counts = _num_accumulated(chief.graph)
    sessions = [tf.compat.v1.Session(w.target, graph=w.graph,
                                     config=support.session_config())
                for w in (chief, other)]
    chief_sess, other_sess = sessions
    coord = tf.compat.v1.train.Coordinator()
    threads = []
    try:
      chief_sess.run([chief.init_op, chief.local_init])
      other_sess.run([other.local_init, other.opt.local_step_init_op])
      early = support.BoundedThread(
          lambda: other_sess.run(other.train_op, options=RUN_OPTIONS),
          name="early-push")
      early.start()
      support.wait_until(lambda: sum(chief_sess.run(counts)) == 1, timeout=30,
                         what="the non-chief's early push")
      chief_sess.run(chief.opt.chief_init_op)
      chief_sess.run(chief.init_tokens)
      threads = chief.opt.get_chief_queue_runner().create_threads(
          chief_sess, coord=coord, daemon=True, start=True)
      early.finish()
      steps = []
      for i, want in enumerate(EARLY_PUSH_STEPS):
        if i == 0:
          chief_sess.run(chief.train_op, options=RUN_OPTIONS)
        else:
          support.run_concurrently([(s.run, w.train_op)
                                    for w, s in zip((chief, other), sessions,
                                                  strict=True)])
        support.wait_until(lambda: chief_sess.run(chief.global_step) >= want,
                           timeout=30, what="global step %d" % want)
        steps.append(int(chief_sess.run(chief.global_step)))
      local_steps = [int(s.run(w.local_step))
                     for w, s in zip((chief, other), sessions, strict=True)]
      values = chief_sess.run(chief.w)
      if opt_cls is support.STOCK:
        support.wait_for_stock_runner_to_block(threads)
    finally:
      coord.request_stop()
      try:
        coord.join(threads, stop_grace_period_secs=GRACE_SECS)
      except RuntimeError:
        pass  # Stock's runner outlives the grace: the matrix checks that.
      for s in sessions:
        s.close()
  return steps, local_steps, values


@pytest.mark.parametrize("step_dtype", [tf.int64, tf.int32],
                         ids=["int64", "int32"])
def test_a_push_before_the_chiefs_init_counts_as_with_stock(step_dtype):
  """On the job's first start nothing earlier exists to clear, so
  ``chief_init_op`` keeps what the accumulators hold, as stock does."""
  stock = _train_with_an_early_push(support.STOCK, step_dtype)
  ours = _train_with_an_early_push(support.OURS, step_dtype)
  assert ours[0] == stock[0] == EARLY_PUSH_STEPS
  assert ours[1] == stock[1] == [EARLY_PUSH_STEPS[-1]] * 2
  np.testing.assert_array_equal(ours[2], stock[2])
  assert not np.array_equal(ours[2], np.zeros(4, np.float32))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_statistics_work_in_every_drive_mode(mode):
  """Opt-in statistics rely on no init op of ours: any mode trains with them
  to the numbers of the default build, and counts exactly.

  Both workers push every round: 6 pushes and 6 tokens each; round 2's
  pushes carry local step 0 after update 1 and are dropped (1 step stale);
  5 updates of 2 gradients.
  """
  plain = _train(support.OURS, mode, tf.int64)
  statistics = []
  counted = _train(support.OURS, mode, tf.int64,
                   opt_kwargs=dict(statistics=True, statistics_log_steps=None),
                   statistics=statistics)
  assert counted[0] == plain[0] == STEPS_AFTER_ROUND
  np.testing.assert_array_equal(counted[2], plain[2])
  assert counted[3] is None, counted[3]
  for task, values in enumerate(statistics):
    worker = {k.split("/", 1)[1]: values[k] for k in values
              if k.startswith("worker/")}
    assert (worker["gradients_pushed"], worker["gradients_dropped_stale"],
            worker["tokens_taken"], worker["staleness_max"]) == (
                ROUNDS, 1, ROUNDS, 1), (task, worker)
  chief = statistics[0]
  assert (chief["cluster/gradients_pushed"],
          chief["cluster/gradients_dropped_stale"],
          chief["cluster/tokens_taken"], chief["cluster/staleness_sum"],
          chief["chief/updates_applied"]) == (
              2 * ROUNDS, 2, 2 * ROUNDS, 2, STEPS_AFTER_ROUND[-1]), chief
  assert chief["chief/gradients_per_update"] == 2.0, chief


class _Logged(logging.Handler):
  """Keeps the message of every record its logger emits."""

  def __init__(self):
    super().__init__()
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@pytest.mark.parametrize("opt_cls", [support.STOCK, support.OURS],
                         ids=["stock", "ours"])
def test_a_workers_graph_leaves_nothing_unused(opt_cls):
  """A worker's graph holds nothing that TensorFlow wants used: dropped after
  the hook's modes ran only what they need (none of the worker's own init or
  readiness ops), it logs no "Object was never used" ERROR block, which a
  green run of this file printed at exit when every worker built a readiness
  op that only the plain session's non-chief ran.
  """
  logged = _Logged()
  tf_logger = logging.getLogger("tensorflow")
  tf_logger.addHandler(logged)
  try:
    workers = [_Worker(opt_cls, "", task, step_dtype=tf.int64)
               for task in range(2)]
    del workers
    gc.collect()  # TensorFlow logs the block as an unused result is freed.
  finally:
    tf_logger.removeHandler(logged)
  assert not [m for m in logged.messages if "never used" in m], (
      logged.messages)


# ------------------------------------------- what prompt stop relies on: coord


def _one_worker(target, opt_cls=support.OURS, **opt_kwargs):
  """A one-replica graph; returns (graph, opt, train_op, global_step)."""
  del target  # Graphs are target-free; the session picks the server.
  graph = tf.Graph()
  with graph.as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    v = tf.compat.v1.Variable([1.0, 2.0])
    opt = opt_cls(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                  replicas_to_aggregate=1, **opt_kwargs)
    train_op = opt.minimize(tf.reduce_sum(v * v), global_step=global_step)
  return graph, opt, train_op, global_step


def _started_session(target, graph, opt):
  sess = tf.compat.v1.Session(target, graph=graph,
                              config=support.session_config())
  with graph.as_default():
    sess.run([tf.compat.v1.global_variables_initializer(),
              tf.compat.v1.local_variables_initializer()])
    sess.run(opt.chief_init_op)
    sess.run(opt.get_init_tokens_op())
  return sess


def test_create_threads_without_coordinator_makes_stocks_threads():
  """No coordinator, no stop request: the threads are stock's QueueRunner's."""
  server = tf.distribute.Server.create_local_server()
  graph, opt, train_op, global_step = _one_worker(server.target)
  sess = _started_session(server.target, graph, opt)
  try:
    threads = opt.get_chief_queue_runner().create_threads(
        sess, daemon=True, start=True)
    assert [t.name for t in threads] == [
        "QueueRunnerThread-sync_token_q-sync_token_q_EnqueueMany"]
    for want in (1, 1, 2):
      sess.run(train_op, options=RUN_OPTIONS)
      support.wait_until(lambda: sess.run(global_step) >= want, timeout=30,
                         what="global step %d" % want)
  finally:
    sess.close()  # Cancels the thread's blocked take, as with stock.
  for t in threads:
    t.join(30)
    assert not t.is_alive(), "stock's runner thread outlived its session"


def test_closing_the_chief_session_without_a_stop_ends_the_runner(impl):
  """Stock's thread dies with its session; ours (on a session of its own)
  must follow, or it would keep taking gradients after the script moved on.
  Both report the cancelled step to the coordinator."""
  server = tf.distribute.Server.create_local_server()
  graph, opt, train_op, global_step = _one_worker(server.target, impl)
  sess = _started_session(server.target, graph, opt)
  coord = tf.compat.v1.train.Coordinator()
  try:
    threads = opt.get_chief_queue_runner().create_threads(
        sess, coord=coord, daemon=True, start=True)
    sess.run(train_op, options=RUN_OPTIONS)
    support.wait_until(lambda: sess.run(global_step) >= 1, timeout=30,
                       what="global step 1")
  finally:
    sess.close()
  loop = [t for t in threads if t.name.startswith("SyncQueueRunner-")
          or t.name.endswith("_EnqueueMany")]
  assert len(loop) == 1, [t.name for t in threads]
  loop[0].join(30)
  assert not loop[0].is_alive(), (
      "the sync loop still runs 30 s after its chief session closed")
  # Cancelled if the close caught the step blocked, "Session is closed" if
  # the thread was between steps: which one is a matter of timing.
  with pytest.raises((tf.errors.CancelledError,
                      tf.errors.FailedPreconditionError)):
    coord.join(threads, stop_grace_period_secs=30)


def test_deadline_runner_without_coordinator_says_what_to_pass():
  server = tf.distribute.Server.create_local_server()
  graph, opt, _, _ = _one_worker(server.target, min_replicas_to_aggregate=1,
                                 aggregation_deadline_secs=1.0)
  sess = tf.compat.v1.Session(server.target, graph=graph)
  try:
    with pytest.raises(ValueError, match=r"needs a coordinator, got "
                       r"coord=None\. Pass coord="):
      opt.get_chief_queue_runner().create_threads(sess)
  finally:
    sess.close()

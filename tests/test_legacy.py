"""The 0.x APIs: the queue-based optimizer of 0.8 to 0.11 and 0.12's V2 name.

Cluster tests drive the chief's update op by hand (one ``sess.run`` of the
queue runner's op per update) so that every value is exact; the Supervisor
tests run the documented flow with the queue runner in its thread. Each
cluster test gets a fresh in-process LocalCluster, except the clean-up op's,
which aborts a whole process and so runs its ps and chief as subprocesses.
"""

import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import legacy

#: Ops here block only when a test is broken; fail fast then.
TIMEOUT_MS = 15_000
LEARNING_RATE = 2.0


def assert_close(actual, expected):
  np.testing.assert_allclose(actual, expected, rtol=1e-6)


# --------------------------------------------------------------------- models


def tf_test_model(worker_id):
  """TensorFlow's sync_replicas test model: two dense variables, one sparse.

  Worker ``i`` pushes ``0.1 + 0.2 i`` to v0, ``0.9 + 0.2 i`` to v1 and a row
  ``0.1 + 0.2 i`` at index 1 to v_sparse.
  """
  with tf.compat.v1.device("/job:ps/task:0"):
    v0 = tf.compat.v1.Variable(0.0, name="v0")
  with tf.compat.v1.device("/job:ps/task:1"):
    v1 = tf.compat.v1.Variable(1.0, name="v1")
    v_sparse = tf.compat.v1.Variable([[3.0], [4.0]], name="v_sparse")
  g0 = tf.constant(0.1 + worker_id * 0.2)
  g1 = tf.constant(0.9 + worker_id * 0.2)
  g_sparse = tf.IndexedSlices(
      tf.constant([0.1 + worker_id * 0.2], shape=[1, 1]), tf.constant([1]),
      tf.constant([2, 1]))
  return [v0, v1, v_sparse], [g0, g1, g_sparse]


class Worker:
  """One replica with the legacy optimizer, in its own graph and session.

  ``model(worker_id)`` returns ``(variables, gradients)``; it is called under
  the worker's device scope and places its variables on the ps itself.
  """

  def __init__(self, cluster, worker_id, model, *, replicas_to_aggregate,
               total_num_replicas, num_tokens=-1, opt=None):
    self.graph = tf.Graph()
    with self.graph.as_default():
      with tf.compat.v1.device("/job:ps/task:0"):
        self.global_step = tf.compat.v1.Variable(0, name="global_step",
                                                 trainable=False)
      with tf.compat.v1.device("/job:worker/task:%d" % worker_id):
        self.variables, grads = model(worker_id)
        self.opt = legacy.SyncReplicasOptimizer(
            opt or tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE),
            replicas_to_aggregate=replicas_to_aggregate,
            replica_id=worker_id, total_num_replicas=total_num_replicas)
        self.train_op = self.opt.apply_gradients(
            zip(grads, self.variables, strict=True),
            global_step=self.global_step)
        self.init_tokens_op = self.opt.get_init_tokens_op(num_tokens)
        self.update_op = self.opt.get_chief_queue_runner().enqueue_ops[0]
        sizes = []
        for queue, device in self.opt.gradient_queues:
          with tf.compat.v1.device(device):
            sizes.append(queue.size())
        self.queue_sizes = tf.stack(sizes)
        self.token_count = self.opt.token_queue.size()
        self.init_op = tf.compat.v1.global_variables_initializer()
    self.session = tf.compat.v1.Session(
        cluster.worker_targets[worker_id], graph=self.graph,
        config=support.session_config(TIMEOUT_MS))

  def start_as_chief(self):
    self.session.run(self.init_op)
    self.session.run(self.init_tokens_op)

  def step(self):
    self.session.run(self.train_op)

  def update(self):
    """One pass of the chief's queue runner: sum, apply, empty, release."""
    self.session.run(self.update_op)

  def read(self):
    """(global_step, [variable values], local_steps, queue sizes, tokens)."""
    return self.session.run([self.global_step, self.variables,
                             self.opt.local_steps, self.queue_sizes,
                             self.token_count])


def make_workers(model, *, num_workers, replicas_to_aggregate, num_tokens=-1,
                 opt=None, num_ps=2):
  cluster = sync_replicas.LocalCluster(num_workers=num_workers, num_ps=num_ps)
  workers = [Worker(cluster, i, model,
                    replicas_to_aggregate=replicas_to_aggregate,
                    total_num_replicas=num_workers, num_tokens=num_tokens,
                    opt=opt() if opt else None)
             for i in range(num_workers)]
  workers[0].start_as_chief()
  return workers


def close_all(workers):
  for w in reversed(workers):
    w.session.close()


# -------------------------------------------------------- protocol, exactly


def test_sums_gradients_and_skips_a_stale_round():
  workers = make_workers(tf_test_model, num_workers=2,
                         replicas_to_aggregate=2)
  w0, w1 = workers
  try:
    # The initial tokens let both push one after the other.
    w0.step()
    w1.step()
    # Queues: v0, v1, v_sparse tokens, v_sparse rows.
    assert w0.read()[3].tolist() == [2, 2, 2, 2]
    w0.update()
    gs, (v0, v1, v_sparse), local_steps, sizes, tokens = w1.read()
    assert gs == 1
    # Summed, not averaged: 0.1 + 0.3, 0.9 + 1.1, times the rate 2.0.
    assert_close(v0, 0.0 - 2.0 * (0.1 + 0.3))  # -0.8
    assert_close(v1, 1.0 - 2.0 * (0.9 + 1.1))  # -3.0
    assert_close(v_sparse, [[3.0], [4.0 - 2.0 * (0.1 + 0.3)]])
    # The initial tokens carried step 0; two new ones carry step 1.
    assert local_steps.tolist() == [0, 0]
    assert sizes.tolist() == [0, 0, 0, 0] and tokens == 2

    # Both replicas are behind: nothing is pushed, the tokens still move
    # their local steps.
    w0.step()
    w1.step()
    gs, (v0, v1, _), local_steps, sizes, tokens = w1.read()
    assert (gs, tokens) == (1, 0)
    assert local_steps.tolist() == [1, 1]
    assert sizes.tolist() == [0, 0, 0, 0]
    assert_close(v0, -0.8)

    # No tokens left: both must step together with the chief.
    support.run_concurrently([(w0.step,), (w1.step,), (w0.update,)])
    gs, (v0, v1, v_sparse), local_steps, sizes, _ = w1.read()
    assert gs == 2 and local_steps.tolist() == [2, 2]
    assert_close(v0, -0.8 - 0.8)
    assert_close(v1, -3.0 - 4.0)
    assert_close(v_sparse, [[3.0], [3.2 - 0.8]])
    assert sizes.tolist() == [0, 0, 0, 0]
  finally:
    close_all(workers)


def test_empties_queues_and_skips_only_the_replica_behind():
  # One backup: three replicas, two gradients per update.
  workers = make_workers(tf_test_model, num_workers=3,
                         replicas_to_aggregate=2, num_tokens=3)
  w0, w1, w2 = workers
  try:
    for w in workers:
      w.step()
    assert w0.read()[3].tolist() == [3, 3, 3, 3]
    w0.update()
    gs, (v0, v1, v_sparse), _, sizes, tokens = w0.read()
    assert (gs, tokens) == (1, 3)
    # Dense: the first two gradients in the queue; worker 2's is emptied.
    assert_close(v0, 0.0 - 2.0 * (0.1 + 0.3))
    assert_close(v1, 1.0 - 2.0 * (0.9 + 1.1))
    # Sparse (stock's behaviour): after two tokens the chief takes every row
    # queued so far, so the backup's row counts too.
    assert_close(v_sparse, [[3.0], [4.0 - 2.0 * (0.1 + 0.3 + 0.5)]])
    assert sizes.tolist() == [0, 0, 0, 0]

    # All three carry step 0 and are skipped.
    for w in workers:
      w.step()
    gs, (v0, _, _), local_steps, sizes, tokens = w0.read()
    assert (gs, tokens) == (1, 0) and local_steps.tolist() == [1, 1, 1]
    assert sizes.tolist() == [0, 0, 0, 0]

    # Workers 0 and 2 make the update; worker 1, late, takes the third token.
    support.run_concurrently([(w0.step,), (w2.step,), (w0.update,)])
    gs, (v0, v1, v_sparse), local_steps, _, tokens = w0.read()
    assert (gs, tokens) == (2, 1) and local_steps.tolist() == [2, 1, 2]
    assert_close(v0, -0.8 - 2.0 * (0.1 + 0.5))
    assert_close(v1, -3.0 - 2.0 * (0.9 + 1.3))
    assert_close(v_sparse, [[3.0], [2.2 - 2.0 * (0.1 + 0.5)]])
    # Its local step (1) is behind the global step (2): only it is skipped.
    w1.step()
    gs, _, local_steps, sizes, tokens = w0.read()
    assert (gs, tokens) == (2, 0) and local_steps.tolist() == [2, 2, 2]
    assert sizes.tolist() == [0, 0, 0, 0]
  finally:
    close_all(workers)


def sparse_rows_model(worker_id):
  """A three-row variable; worker 1 sends index 2 twice in one gradient."""
  with tf.compat.v1.device("/job:ps/task:0"):
    var = tf.compat.v1.Variable([[3.0], [4.0], [5.0]], name="v_rows")
  values, indices = {0: ([[1.0], [3.0]], [2, 0]),
                     1: ([[0.5], [1.5]], [2, 2])}[worker_id]
  grad = tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                          tf.constant([3, 1]))
  return [var], [grad]


def test_combines_sparse_rows_by_index():
  # Adagrad tells apply(g1 + g2) from apply(g1); apply(g2): with an initial
  # accumulator of 16, a summed row g = 3 moves by 3 / sqrt(16 + 9) = 0.6.
  workers = make_workers(
      sparse_rows_model, num_workers=2, replicas_to_aggregate=2, num_ps=1,
      opt=lambda: tf.compat.v1.train.AdagradOptimizer(
          1.0, initial_accumulator_value=16.0))
  w0, w1 = workers
  try:
    w0.step()
    w1.step()
    assert w0.read()[3].tolist() == [2, 4]  # Tokens, then the four rows.
    w0.update()
    gs, (rows,), _, sizes, _ = w1.read()
    assert gs == 1 and sizes.tolist() == [0, 0]
    # Index 2: 1.0 + 0.5 + 1.5 = 3; index 0: 3.0; index 1: untouched.
    assert_close(rows, [[3.0 - 0.6], [4.0], [5.0 - 0.6]])
    accumulator = w1.opt.get_slot(w1.variables[0], "accumulator")
    assert_close(w1.session.run(accumulator), [[25.0], [16.0], [25.0]])
  finally:
    close_all(workers)


def gated_model(worker_id):
  """v0 only; worker 2's gradient waits for the test to release it.

  Before it waits, worker 2's step enqueues into a queue on ps 0 whose size
  (the tensor "started:0") tells the test that the step has begun.
  """
  with tf.compat.v1.device("/job:ps/task:0"):
    v0 = tf.compat.v1.Variable(0.0, name="v0")
  if worker_id != 2:
    return [v0], [tf.constant(0.1 + worker_id * 0.2)]
  gate = tf.queue.FIFOQueue(1, tf.float32, shapes=(), shared_name="gate")
  gate.enqueue(0.5, name="release")
  with tf.compat.v1.device("/job:ps/task:0"):
    started = tf.queue.FIFOQueue(1, tf.int32, shapes=(),
                                 shared_name="gate_started")
    started.size(name="started")
  with tf.control_dependencies([started.enqueue(1)]):
    return [v0], [gate.dequeue()]


def test_known_race_counts_a_late_gradient_in_the_next_update():
  workers = make_workers(gated_model, num_workers=3, replicas_to_aggregate=2)
  w0, w1, w2 = workers
  release = w2.graph.get_operation_by_name("release")
  try:
    # Worker 2 passes the staleness check at step 0, then waits for its
    # gradient. The check's reads have no inputs: they run as the step
    # begins, on ps 0, as does the enqueue that says it began. Once that is
    # seen, the update below is several session runs away, and the check
    # read step 0 long before (if it ever read step 1, worker 2's gradient
    # would be dropped: the queue sizes below would say so).
    late = support.BoundedThread(w2.step, name="worker2")
    late.start()
    started = w2.graph.get_tensor_by_name("started:0")
    support.wait_until(lambda: w2.session.run(started) == 1, timeout=20,
                       what="worker 2's step to begin")
    w0.step()
    w1.step()
    w0.update()
    assert w0.read()[0] == 1
    # Its gradient lands after the chief emptied the queues.
    w2.session.run(release)
    late.finish(10)
    gs, (v0,), local_steps, sizes, _ = w0.read()
    assert (gs, local_steps.tolist(), sizes.tolist()) == (1, [0, 0, 1], [1])
    assert_close(v0, 0.0 - 2.0 * (0.1 + 0.3))

    # Workers 0 and 1 are behind and skipped; the step-0 gradient waits.
    w0.step()
    w1.step()
    assert w0.read()[3].tolist() == [1]
    # The next update counts it with worker 0's fresh one.
    support.run_concurrently([(w0.step,), (w0.update,)], timeout=10)
    gs, (v0,), _, sizes, _ = w0.read()
    assert gs == 2 and sizes.tolist() == [0]
    assert_close(v0, -0.8 - 2.0 * (0.5 + 0.1))
  finally:
    close_all(workers)


def test_chief_applies_variable_averages_after_the_update():
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  graph = tf.Graph()
  with graph.as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      var = tf.compat.v1.Variable(1.0, name="v")
    ema = tf.compat.v1.train.ExponentialMovingAverage(0.5)
    opt = legacy.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0),
        replicas_to_aggregate=1, replica_id=0, variable_averages=ema,
        variables_to_average=[var])
    train_op = opt.apply_gradients([(tf.constant(1.0), var)],
                                   global_step=global_step)
    init_ops = [tf.compat.v1.global_variables_initializer(),
                opt.get_init_tokens_op()]
    update_op = opt.get_chief_queue_runner().enqueue_ops[0]
    shadow = ema.average(var)
  with tf.compat.v1.Session(cluster.worker_targets[0], graph=graph,
                            config=support.session_config(TIMEOUT_MS)) as sess:
    for op in init_ops:
      sess.run(op)
    sess.run(train_op)
    sess.run(update_op)
    # v: 1 - 1.0; its average, from 1.0 halfway towards 0.0.
    assert sess.run([global_step, var, shadow]) == [1, 0.0, 0.5]


# ------------------------------------------------------------ the Supervisor


def supervised_worker(kind, cluster, worker_id, logdir):
  """One replica set up the way the 0.11/0.12 documentation shows.

  Returns ``(session, supervisor, train_op, fetches)``; ``fetches`` reads
  (global step, v0, v_sparse, this replica's local step).
  """
  graph = tf.Graph()
  is_chief = worker_id == 0
  with graph.as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      v0 = tf.compat.v1.Variable(0.0, name="v0")
    with tf.compat.v1.device("/job:ps/task:1"):
      v_sparse = tf.compat.v1.Variable([[3.0], [4.0]], name="v_sparse")
    with tf.compat.v1.device("/job:worker/task:%d" % worker_id):
      grads = [tf.constant(0.1 + worker_id * 0.2),
               tf.IndexedSlices(tf.constant([[0.1 + worker_id * 0.2]]),
                                tf.constant([1]), tf.constant([2, 1]))]
      sgd = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)
      kwargs = {}
      if kind == "legacy":
        opt = legacy.SyncReplicasOptimizer(
            sgd, replicas_to_aggregate=2, replica_id=worker_id,
            total_num_replicas=2)
      else:
        opt_cls = {"v2": legacy.SyncReplicasOptimizerV2,
                   "stock": support.STOCK}[kind]
        # Ours with stock's start (its round 2 is stale, as counted below).
        opt = opt_cls(sgd, replicas_to_aggregate=2, total_num_replicas=2,
                      **({"data_end": "stock"} if kind == "v2" else {}))
      train_op = opt.apply_gradients(zip(grads, [v0, v_sparse], strict=True),
                                     global_step=global_step)
      if kind == "legacy":
        local_step = opt.local_steps[worker_id]
      else:
        local_step = support.local_step_variable(graph)
        kwargs["local_init_op"] = (opt.chief_init_op if is_chief
                                   else opt.local_step_init_op)
        kwargs["ready_for_local_init_op"] = opt.ready_for_local_init_op
      chief_queue_runner = opt.get_chief_queue_runner()
      init_tokens_op = opt.get_init_tokens_op()
      init_op = tf.compat.v1.global_variables_initializer()
    # Short waits, but stock's grace (the test checks that no stop waits
    # it); no checkpoint or summary threads to outlive the test.
    sv = tf.compat.v1.train.Supervisor(
        graph=graph, is_chief=is_chief, logdir=logdir, init_op=init_op,
        recovery_wait_secs=0.2, stop_grace_secs=support.STOCK_GRACE_SECS,
        save_model_secs=0,
        save_summaries_secs=0, summary_op=None, **kwargs)
    sess = sv.prepare_or_wait_for_session(
        cluster.worker_targets[worker_id],
        config=support.session_config(TIMEOUT_MS), max_wait_secs=20)
    if is_chief:
      sv.start_queue_runners(sess, [chief_queue_runner])
      sess.run(init_tokens_op)
  return sess, sv, train_op, [global_step, v0, v_sparse, local_step]


def shut_down(replicas):
  """Stops the Supervisors within their grace period, chief last.

  The chief's queue runner is blocked waiting for gradients that will never
  come (in take_grad, or dequeue_many for the legacy optimizer); closing the
  chief's session cancels that wait, and the runner treats the cancellation
  as a closed queue and ends, so ``stop`` finds no thread left to wait for.
  """
  for _, sv, _, _ in replicas:
    sv.request_stop()
  for sess, _, _, _ in reversed(replicas):
    sess.close()
  for _, sv, _, _ in reversed(replicas):
    sv.stop()


@pytest.mark.parametrize("kind", ["legacy", "v2", "stock"])
def test_supervisor_flow(kind, tmp_path):
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=2)
  replicas = []
  try:
    # The chief first: a non-chief started earlier would wait for it.
    for i in range(2):
      replicas.append(supervised_worker(kind, cluster, i, str(tmp_path)))
    chief, fetches = replicas[0][0], replicas[0][3]

    def run_round():
      support.run_concurrently([(sess.run, op) for sess, _, op, _ in replicas])

    run_round()
    support.wait_until(lambda: chief.run(fetches)[0] == 1, timeout=20,
                       what="global_step == 1")
    run_round()  # Computed at step 0: dropped by both designs.
    run_round()  # Each of these returns once the new step's tokens are out.
    run_round()

    # Three updates: legacy sums, today's design averages.
    scale = 1.0 if kind == "legacy" else 0.5
    for sess, _, _, worker_fetches in replicas:
      gs, v0, v_sparse, local_step = sess.run(worker_fetches)
      assert (gs, local_step) == (3, 3)
      assert_close(v0, 0.0 - 3 * scale * 2.0 * (0.1 + 0.3))
      assert_close(v_sparse, [[3.0], [4.0 - 3 * scale * 2.0 * (0.1 + 0.3)]])
    started = time.monotonic()
    shut_down(replicas)
    assert time.monotonic() - started < support.prompt_secs(TIMEOUT_MS), (
        "a Supervisor waited its grace")
    replicas = []
  finally:
    shut_down(replicas)


# ---------------------------------------------------------------- clean-up


def build_legacy(graph, **kwargs):
  """The legacy optimizer applied to one ps variable; returns it and its op."""
  with graph.as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      var = tf.compat.v1.Variable([1.0, 2.0], name="v")
    kwargs.setdefault("replica_id", 0)
    opt = legacy.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0),
        replicas_to_aggregate=2, **kwargs)
    train_op = opt.apply_gradients([(tf.constant([1.0, 1.0]), var)],
                                   global_step=global_step)
  return opt, train_op


def test_clean_up_op_aborts_on_the_global_step_device(graph):
  opt, _ = build_legacy(graph)
  op = opt.get_clean_up_op()
  assert op.type == "Abort"
  assert op.device == "/job:ps/task:0"
  assert op.get_attr("error_msg") == b"From sync_replicas"
  assert not op.get_attr("exit_without_error")


_PS_SCRIPT = """
import sys
import time
import tensorflow as tf
spec = tf.train.ClusterSpec({"worker": [sys.argv[1]], "ps": [sys.argv[2]]})
server = tf.distribute.Server(spec, job_name="ps", task_index=0)
# The chief's clean-up op aborts this process; if it never comes, leave
# after a bound instead of serving forever.
time.sleep(600)
sys.exit("ps: no Abort after 600 s")
"""

# The chief's side. It lives in a process of its own too: once the ps is
# gone, closing a session on it retries the dead task instead of returning.
_CHIEF_SCRIPT = """
import os
import sys
import tensorflow as tf
from sync_replicas import legacy
spec = tf.train.ClusterSpec({"worker": [sys.argv[1]], "ps": [sys.argv[2]]})
server = tf.distribute.Server(spec, job_name="worker", task_index=0)
with tf.Graph().as_default():
  with tf.compat.v1.device("/job:ps/task:0"):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    var = tf.compat.v1.Variable([1.0, 2.0], name="v")
  opt = legacy.SyncReplicasOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(1.0),
      replicas_to_aggregate=1, replica_id=0)
  opt.apply_gradients([(tf.constant([1.0, 1.0]), var)],
                      global_step=global_step)
  sess = tf.compat.v1.Session(server.target, config=tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=20000))
  try:
    sess.run(opt.get_clean_up_op())
    print("no error", flush=True)
  except tf.errors.OpError as e:
    print(type(e).__name__, flush=True)
  os._exit(0)
"""


def test_clean_up_op_kills_the_ps_task(tmp_path):
  # Abort ends the whole process that runs it, so this takes real processes
  # rather than an in-process LocalCluster.
  addresses = ["127.0.0.1:%d" % p for p in sync_replicas.cluster.free_ports(2)]
  processes = []

  # Where ``import sync_replicas`` finds this checkout.
  root = pathlib.Path(sync_replicas.__file__).parents[1]

  def start(script, name, stdout):
    with open(tmp_path / name, "wb") as log:
      processes.append(subprocess.Popen(
          [sys.executable, "-c", script] + addresses, cwd=root,
          stdout=stdout, stderr=log))
    return processes[-1]

  try:
    # Both start at once: the chief's session waits for the ps to come up.
    ps = start(_PS_SCRIPT, "ps.log", subprocess.DEVNULL)
    chief = start(_CHIEF_SCRIPT, "chief.log", subprocess.PIPE)
    # A hang detector: two TensorFlow imports on a loaded machine took 60 s.
    out, _ = chief.communicate(timeout=180)
    # The chief sees its ps vanish; the ps died of the abort, saying why.
    assert out == b"UnavailableError\n", (tmp_path / "chief.log").read_text()
    assert ps.wait(timeout=20) == -signal.SIGABRT
    assert b"From sync_replicas" in (tmp_path / "ps.log").read_bytes()
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)


# ------------------------------------------------------- names and the alias


def test_v2_is_todays_class():
  assert legacy.SyncReplicasOptimizerV2 is sync_replicas.SyncReplicasOptimizer


def test_graph_follows_stock_0_11(graph):
  with tf.compat.v1.device("/job:ps/task:0"):
    global_step = tf.compat.v1.train.get_or_create_global_step()
  with tf.compat.v1.device("/job:worker/task:1"):
    variables, grads = tf_test_model(1)
    opt = legacy.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0),
        replicas_to_aggregate=2, replica_id=1, total_num_replicas=3)
    opt.apply_gradients(zip(grads, variables, strict=True),
                        global_step=global_step)

  local_steps = opt.local_steps
  assert local_steps.op.name == "local_steps"
  assert local_steps.device == "/job:ps/task:0"
  assert local_steps.shape == [3] and local_steps.dtype.base_dtype == tf.int64
  assert local_steps in tf.compat.v1.global_variables()
  assert local_steps not in tf.compat.v1.trainable_variables()

  def shared_name(queue):
    return queue.queue_ref.op.get_attr("shared_name").decode()

  assert [(shared_name(q), dev) for q, dev in opt.gradient_queues] == [
      ("v0:0", "/job:ps/task:0"), ("v1:0", "/job:ps/task:1"),
      ("sparse_token_q_v_sparse:0", "/job:ps/task:1"),
      ("sparse_grad_q_v_sparse:0", "/job:ps/task:1")]
  assert shared_name(opt.token_queue) == "sync_token_q"
  assert shared_name(opt.get_chief_queue_runner().queue) == "dummy_queue"
  # Dense queues hold two steps' worth of tokens, sparse token queues two
  # updates' worth of replicas, as in stock.
  capacities = [q.queue_ref.op.get_attr("capacity")
                for q, _ in opt.gradient_queues]
  assert capacities == [6, 6, 4, -1]
  assert opt.tokens_per_step == 3
  assert opt.variables() == []


def test_total_num_replicas_zero_means_replicas_to_aggregate():
  opt = legacy.SyncReplicasOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(1.0),
      replicas_to_aggregate=4, replica_id=3)
  assert (opt.total_num_replicas, opt.tokens_per_step, opt.replica_id) == (
      4, 4, 3)


# ------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, message", [
    ({"replica_id": None}, r"replica_id is required.*\[0, 2\)"),
    ({"replica_id": 2},
     r"replica_id must be in \[0, total_num_replicas\) = \[0, 2\), got 2"),
    ({"replica_id": -1}, r"= \[0, 2\), got -1"),
    ({"replica_id": 3, "total_num_replicas": 3}, r"= \[0, 3\), got 3"),
    ({"replica_id": True}, r"replica_id must be an int .* got True \(bool\)"),
    ({"replica_id": 1.0}, r"replica_id must be an int .* got 1.0 \(float\)"),
    ({"replicas_to_aggregate": 0},
     r"replicas_to_aggregate must be a positive int, got 0"),
    ({"total_num_replicas": -1},
     r"total_num_replicas must be a non-negative int, got -1"),
    ({"total_num_replicas": "2"},
     r"total_num_replicas must be a non-negative int, got '2' \(str\)"),
    ({"variables_to_average": []},
     "variable_averages and variables_to_average go together"),
])
def test_constructor_rejects(graph, kwargs, message):
  kwargs = dict({"replicas_to_aggregate": 2, "replica_id": 0}, **kwargs)
  with pytest.raises(ValueError, match=message):
    legacy.SyncReplicasOptimizer(support.sgd(), **kwargs)
  assert not graph.get_operations()


def test_constructor_rejects_a_non_optimizer(graph):
  with pytest.raises(TypeError, match="tf.compat.v1.train.Optimizer"):
    legacy.SyncReplicasOptimizer(object(), 2, replica_id=0)
  assert not graph.get_operations()


def test_accessors_before_apply_gradients(graph):
  opt = legacy.SyncReplicasOptimizer(support.sgd(), 2, replica_id=0)
  with pytest.raises(ValueError, match=r"^Should be called after apply_grad"):
    opt.get_chief_queue_runner()
  with pytest.raises(ValueError, match=r"^get_init_tokens_op\(\) should be"):
    opt.get_init_tokens_op()
  with pytest.raises(ValueError, match=r"^get_clean_up_op\(\) should be"):
    opt.get_clean_up_op()
  with pytest.raises(AttributeError, match="local_steps is only available"):
    _ = opt.local_steps
  assert not opt.is_built and not graph.get_operations()


def _unknown_shape_variable():
  return tf.compat.v1.Variable(
      tf.compat.v1.placeholder_with_default([1.0], shape=[None]),
      validate_shape=False, name="unknown")


@pytest.mark.parametrize("case, message", [
    ("empty", "^Must supply at least one variable$"),
    ("no_global_step", "^Global step is required to check staleness"),
    ("float_global_step", "must be an int32 or int64 variable.*float32"),
    ("unknown_grad_type", r"^Unknown grad type! .* got list"),
    ("no_gradient", r"^No gradients provided for any variable: \['v:0'\]"),
    ("not_pairs", r"must hold \(gradient, variable\) pairs"),
    ("unknown_shape", "need a fully defined"),
    ("sparse_scalar", "sparse gradient needs a variable of rank >= 1"),
])
def test_apply_gradients_rejects_before_building(graph, case, message):
  with tf.compat.v1.device("/job:ps/task:0"):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    var = tf.compat.v1.Variable([1.0, 2.0], name="v")
  grad = tf.constant([1.0, 1.0])
  args = {
      "empty": ([], global_step),
      "no_global_step": ([(grad, var)], None),
      "float_global_step": ([(grad, var)], tf.compat.v1.Variable(0.0)),
      "unknown_grad_type": ([([1.0, 1.0], var)], global_step),
      "no_gradient": ([(None, var)], global_step),
      "not_pairs": ([grad], global_step),
      "unknown_shape": ([(grad, _unknown_shape_variable())], global_step),
      "sparse_scalar": (
          [(tf.IndexedSlices(tf.constant([1.0]), tf.constant([0])),
            tf.compat.v1.Variable(1.0))], global_step),
  }[case]
  before = len(graph.get_operations())
  opt = legacy.SyncReplicasOptimizer(support.sgd(), 2, replica_id=0)
  with pytest.raises(ValueError, match=message):
    opt.apply_gradients(args[0], global_step=args[1])
  assert len(graph.get_operations()) == before and not opt.is_built


def test_apply_gradients_twice_and_too_few_tokens(graph):
  opt, _ = build_legacy(graph, total_num_replicas=1)
  grad = tf.constant([1.0, 1.0])
  before = len(graph.get_operations())
  with pytest.raises(RuntimeError, match="already called"):
    opt.apply_gradients([(grad, opt.local_steps)],
                        global_step=tf.compat.v1.train.get_global_step())
  # Two gradients per update from one replica: one extra token is needed.
  with pytest.raises(ValueError, match=r"^Too few tokens to finish the first "
                     r"step: 0 \(given\) vs 1 \(needed\)"):
    opt.get_init_tokens_op(0)
  with pytest.raises(ValueError, match="num_tokens must be an int"):
    opt.get_init_tokens_op(1.5)
  assert len(graph.get_operations()) == before
  assert opt.get_init_tokens_op(1).type == "QueueEnqueueManyV2"

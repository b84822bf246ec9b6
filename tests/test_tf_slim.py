"""tf-slim's training loop, ``tf_slim.learning.train``, with stock and ours.

Two workers on a LocalCluster (1 ps), each in its own graph and thread,
call tf-slim's ``train`` with ``sync_optimizer``: stock's directly, ours
through ``sync_replicas.slim_train``. tf-slim builds a Supervisor with
``chief_init_op`` / ``local_step_init_op`` and ``ready_for_local_init_op``,
starts the chief queue runner and runs the init tokens on the chief, and
stops training once the global step reaches ``number_of_steps``.

A ``train_step_fn`` around tf-slim's ``train_step`` makes both workers step
together, round after round, and every gradient is a small multiple of
1/8, so which gradients count does not depend on thread timing and the
sums are exact: stock and ours must agree to the bit.

Stock's failure, shown here: once training stops, the Supervisor's
``stop()`` (from ``managed_session``'s exit; tf-slim passes no logdir
here) waits ``stop_grace_secs``, 120 s, which tf-slim does not expose,
because stock's queue-runner thread is blocked taking gradients nobody
will push; then it raises. The test does not wait that long: it checks
that stock's chief is still inside ``train`` a few seconds after its last
step, then closes its session, which ends the blocked thread.
"""

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import support
import sync_replicas

tf_slim = support.require(
    "tf_slim", why="tests/test_tf_slim.py runs slim_train against "
    "tf_slim.learning.train")

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOGDIR_TASK = pathlib.Path(__file__).with_name("slim_logdir_task.py")
LR = 0.5
#: train() stops once the global step reaches this.
NUMBER_OF_STEPS = 4
#: Ours' chief must return from train() within this after its last step.
PROMPT_SECS = support.PROMPT_SECS  # tf-slim waits 120 s or an op timeout.
#: Stock's chief is checked to be still inside train() this long after it.
BLOCKED_SECS = 3.0
#: Bounds a round: both workers meet at the barrier before every step.
BARRIER_SECS = 60.0

# Closing stock's chief session ends its blocked queue-runner thread with a
# CancelledError traceback: stock's known behaviour, not this test's failure.
pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")


def _dyadic(rng, shape):
  return rng.integers(-8, 9, size=shape).astype(np.float32) / 8


class SlimWorker:
  """One worker's graph: a dyadic model, its train op and optimizer.

  ``w`` ([4]) and ``m`` ([2, 3]) live on ps 0. Worker ``task`` has the
  loss ``0.5 |w - t|^2 + sum(m * c)`` with its own dyadic ``t`` and ``c``:
  the gradients ``w - t`` and ``c`` stay dyadic under SGD at rate 1/2, so
  their means are exact.
  """

  def __init__(self, opt_cls, cluster, task, *, step_dtype):
    self.task = task
    self.is_chief = task == 0
    self.target = cluster.worker_targets[task]
    self.graph = tf.Graph()
    rng = np.random.default_rng(7 + task)
    with self.graph.as_default():
      with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
          ps_tasks=1, worker_device="/job:worker/task:%d" % task)):
        if step_dtype == tf.int64:
          # As a model zoo script: tf-slim finds or makes the global step.
          self.global_step = tf.compat.v1.train.get_or_create_global_step()
        else:
          self.global_step = tf.compat.v1.get_variable(
              "global_step", [], step_dtype,
              initializer=tf.zeros_initializer(), trainable=False)
        w = tf.compat.v1.get_variable(
            "w", initializer=tf.constant([1.0, -1.0, 0.5, 2.0]))
        m = tf.compat.v1.get_variable("m", initializer=tf.fill([2, 3], 0.25))
        loss = (0.5 * tf.reduce_sum(tf.square(w - _dyadic(rng, [4])))
                + tf.reduce_sum(m * _dyadic(rng, [2, 3])))
        self.opt = opt_cls(tf.compat.v1.train.GradientDescentOptimizer(LR),
                           replicas_to_aggregate=2, total_num_replicas=2)
        self.train_op = tf_slim.learning.create_train_op(
            loss, self.opt, global_step=self.global_step)

  def train(self, train_fn, step_fn, logdir):
    """Runs ``train_fn`` (tf-slim's train or ours) as a zoo script would.

    Inside the graph: tf-slim builds its Supervisor outside ``graph``, and
    under TF 2's default eager mode Supervisor refuses to start (a ported
    script calls ``tf.compat.v1.disable_eager_execution()`` instead).
    """
    with self.graph.as_default():
      return train_fn(
          self.train_op, logdir, train_step_fn=step_fn, graph=self.graph,
          master=self.target, is_chief=self.is_chief,
          global_step=self.global_step, number_of_steps=NUMBER_OF_STEPS,
          sync_optimizer=self.opt, session_config=support.session_config(),
          log_every_n_steps=0)


class Run:
  """Two SlimWorkers trained with tf-slim; what the test checks afterwards.

  Attributes:
    variables: (global_step, w, m) read from ps 0 once both workers are
      past their last step.
    losses: What each worker's train() returned, its last round's loss;
      None for a chief that had not returned after BLOCKED_SECS.
    chief_stop_secs: From the chief's last step to train() returning; None
      if it had not returned after BLOCKED_SECS.
  """

  def __init__(self, opt_cls, train_fn, *, step_dtype, logdir=None):
    cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
    workers = [SlimWorker(opt_cls, cluster, t, step_dtype=step_dtype)
               for t in range(2)]
    barrier = threading.Barrier(2, timeout=BARRIER_SECS)
    chief_ready = threading.Event()
    last_step_at = [None, None]
    chief_session = []
    returned_at = [None, None]

    threads_before = set(threading.enumerate())
    hold_error = []

    def step_fn_of(task):
      def step_fn(sess, train_op, global_step, kwargs):
        if task == 0 and not chief_ready.is_set():
          chief_session.append(sess)
          chief_ready.set()
        # Both workers step together: the rounds, and so which gradients
        # are fresh, do not depend on thread timing.
        barrier.wait()
        loss, should_stop = tf_slim.learning.train_step(
            sess, train_op, global_step, kwargs)
        if should_stop:
          if task == 0 and opt_cls is support.STOCK:
            try:
              support.wait_for_stock_runner_to_block(
                  [t for t in threading.enumerate()
                   if t not in threads_before
                   and t.name.startswith("QueueRunnerThread-sync_token_q")])
            except AssertionError as e:
              hold_error.append(e)
              raise
          last_step_at[task] = time.monotonic()
        return loss, should_stop
      return step_fn

    def train(task):
      loss = workers[task].train(train_fn, step_fn_of(task), logdir)
      returned_at[task] = time.monotonic()
      return loss

    chief = support.BoundedThread(train, 0, name="slim-chief")
    other = support.BoundedThread(train, 1, name="slim-worker-1")
    chief.start()
    # The other starts once the chief's model is initialized: its
    # Supervisor would otherwise sleep 30 s (recovery_wait_secs, which
    # tf-slim does not expose) before looking again.
    support.wait_until(lambda: chief_ready.is_set() or not chief.is_alive(),
                       timeout=60, what="the chief's first tf-slim step")
    if not chief_ready.is_set():
      chief.finish(timeout=1)  # Raises the chief's error.
    other.start()
    other_loss = other.finish(timeout=120)
    support.wait_until(lambda: last_step_at[0] is not None or hold_error,
                       timeout=30, what="the chief's last step")
    if hold_error:
      chief_session[0].close()  # Its stop would wait out the 120 s grace.
      raise hold_error[0]
    self.variables = self._read(cluster, step_dtype)
    # Stock's chief blocks in Supervisor.stop() for 120 s: look once, after
    # BLOCKED_SECS, instead of waiting it out. Ours may take up to
    # PROMPT_SECS: a loaded machine's prompt stop can outlast BLOCKED_SECS.
    look = BLOCKED_SECS if opt_cls is support.STOCK else PROMPT_SECS
    chief.join(max(0.0, last_step_at[0] + look - time.monotonic()))
    self.chief_alive_after_blocked_secs = chief.is_alive()
    if chief.is_alive():
      # Cancels stock's blocked take_grad, which ends its queue-runner
      # thread, then Supervisor.stop() and train().
      chief_session[0].close()
      chief.join(30)
      assert not chief.is_alive(), "closing the chief's session did not end it"
      # The close may surface as a CancelledError; anything else (this
      # file's own wait failing, say) is the chief's real error.
      if not isinstance(chief.error, (type(None), tf.errors.CancelledError)):
        raise chief.error
      self.losses = [None, other_loss]
      self.chief_stop_secs = None
    else:
      self.losses = [chief.finish(timeout=1), other_loss]
      self.chief_stop_secs = returned_at[0] - last_step_at[0]

  @staticmethod
  def _read(cluster, step_dtype):
    with tf.Graph().as_default():
      with tf.compat.v1.device("/job:ps/task:0"):
        fetches = [tf.compat.v1.get_variable("global_step", [], step_dtype),
                   tf.compat.v1.get_variable("w", [4]),
                   tf.compat.v1.get_variable("m", [2, 3])]
      with tf.compat.v1.Session(cluster.worker_targets[1],
                                config=support.session_config()) as sess:
        return sess.run(fetches)


STEP_DTYPES = [pytest.param(tf.int64, id="int64"),
               pytest.param(tf.int32, id="int32")]


@pytest.fixture(scope="module", params=STEP_DTYPES)
def runs(request):
  """(stock's run, ours' run) for one global step dtype."""
  stock = Run(support.STOCK, tf_slim.learning.train, step_dtype=request.param)
  ours = Run(support.OURS, sync_replicas.slim_train,
             step_dtype=request.param)
  return stock, ours


def test_slim_train_with_ours_matches_stock_bit_for_bit(runs):
  stock, ours = runs
  for got, want, name in zip(ours.variables, stock.variables,
                             ["global_step", "w", "m"], strict=True):
    np.testing.assert_array_equal(got, want, err_msg=name)
  # The non-chief's last loss, computed from the same variables.
  assert ours.losses[1] == stock.losses[1]
  # Training moved the variables: the comparison is not of initial values.
  assert not np.array_equal(ours.variables[1], [1.0, -1.0, 0.5, 2.0])


def test_slim_train_stops_at_number_of_steps(runs):
  stock, ours = runs
  assert stock.variables[0] == NUMBER_OF_STEPS
  assert ours.variables[0] == NUMBER_OF_STEPS


def test_slim_train_chief_returns_promptly_with_ours(runs):
  _, ours = runs
  assert not ours.chief_alive_after_blocked_secs
  assert ours.chief_stop_secs < PROMPT_SECS, (
      "ours' chief took %.1fs from its last step to return from "
      "tf_slim's train(): Supervisor.stop() waited for its grace period"
      % ours.chief_stop_secs)


def test_stock_chief_still_blocked_in_train_after_last_step(runs):
  stock, _ = runs
  # Stock's failure: Supervisor.stop() waits 120 s for its queue runner,
  # blocked in take_grad, then raises "threads still running".
  assert stock.chief_alive_after_blocked_secs


def test_slim_train_with_logdir_saves_and_returns_promptly_with_ours(
    tmp_path):
  # With a logdir, tf-slim's chief saves a checkpoint and calls
  # Supervisor.stop() itself, then managed_session's exit calls it again.
  # Its service threads need eager execution off process-wide, as in a
  # ported script: hence a process of its own.
  env = dict(os.environ, PYTHONPATH=support.pythonpath(ROOT),
             TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(LOGDIR_TASK), str(tmp_path)], env=env,
      capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["global_step"] == 3
  assert result["stop_secs"] < PROMPT_SECS, result
  checkpoint = tf.train.latest_checkpoint(str(tmp_path))
  assert checkpoint is not None and checkpoint.endswith("-3"), checkpoint


def test_slim_train_accepts_stock_optimizer():
  via_adapter = Run(support.STOCK, sync_replicas.slim_train,
                    step_dtype=tf.int64)
  direct = Run(support.STOCK, tf_slim.learning.train, step_dtype=tf.int64)
  for got, want in zip(via_adapter.variables, direct.variables,
                           strict=True):
    np.testing.assert_array_equal(got, want)
  assert via_adapter.variables[0] == NUMBER_OF_STEPS
  # The adapter changes nothing for stock, its blocked stop included.
  assert via_adapter.chief_alive_after_blocked_secs


def _built_ours():
  """A graph, our optimizer and tf-slim's train op on it (no cluster)."""
  graph = tf.Graph()
  with graph.as_default():
    v = tf.compat.v1.Variable([1.0, 2.0], name="v")
    opt = support.OURS(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                       replicas_to_aggregate=1, total_num_replicas=1)
    train_op = tf_slim.learning.create_train_op(tf.reduce_sum(v * v), opt)
  return graph, opt, train_op


def test_tf_slim_train_rejects_ours_without_the_adapter():
  graph, opt, train_op = _built_ours()
  # In a list, ours reaches tf-slim's check and fails it.
  with pytest.raises(ValueError, match="must be a tf.train.SyncReplicas"):
    tf_slim.learning.train(train_op, None, graph=graph,
                           sync_optimizer=[opt])
  # Alone, tf-slim's first check does not wrap it in a list, and iterating
  # over it fails before the check.
  with pytest.raises(TypeError, match="not iterable"):
    tf_slim.learning.train(train_op, None, graph=graph, sync_optimizer=opt)


def test_slim_train_leaves_tf_slim_unchanged():
  learning = tf_slim.learning
  module, train = learning.sync_replicas_optimizer, learning.train
  graph, opt, train_op = _built_ours()
  # tf-slim's own checks still raise for anything else, through ours too.
  with pytest.raises(ValueError, match="must be a tf.train.SyncReplicas"):
    sync_replicas.slim_train(train_op, None, graph=graph,
                             sync_optimizer=[opt, object()])
  assert learning.sync_replicas_optimizer is module
  assert learning.train is train
  assert not isinstance(opt, module.SyncReplicasOptimizer)


def test_slim_train_without_tf_slim_says_how_to_install(monkeypatch):
  # A None entry makes `import tf_slim` raise ImportError.
  monkeypatch.setitem(sys.modules, "tf_slim", None)
  with pytest.raises(ImportError, match=r"pip install tf-slim==1\.1\.0"):
    sync_replicas.slim_train(None, None)

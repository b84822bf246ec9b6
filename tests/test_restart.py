"""A chief that restarts leaves nothing stale behind (in-process, step by step).

A "crash" here is a chief that stops running its ops; the restarted chief
runs ``chief_init_op`` again on the same ps, as MonitoredSession or
Supervisor do. Stock's restart keeps the gradients pushed before the crash
and accepts pushes from tokens of the lost updates; ours drops both.
"""

import numpy as np
import pytest
import tensorflow as tf

import sync_replicas
import support


class Replica:
  """One task's graph with plain sessions, driven op by op (no threads)."""

  def __init__(self, impl, cluster, task, *, step_dtype=tf.int64,
               **opt_kwargs):
    self.graph = tf.Graph()
    with self.graph.as_default():
      with tf.compat.v1.device("/job:ps/task:0"):
        self.global_step = tf.compat.v1.get_variable(
            "global_step", [], step_dtype, trainable=False,
            initializer=tf.zeros_initializer())
        self.v = tf.compat.v1.get_variable("v", [2],
                                           initializer=tf.zeros_initializer())
        # A second handle on the shared accumulator and token queue, as
        # any task (or the status tool) can make: read-only counts.
        counts = tf.compat.v1.ConditionalAccumulator(
            tf.float32, shape=[2], shared_name=self.v.name + "/grad_accum")
        self.num_accumulated = counts.num_accumulated()
        self.tokens = tf.queue.FIFOQueue(
            -1, step_dtype, shapes=(), shared_name="sync_token_q").size()
      with tf.compat.v1.device("/job:worker/task:%d" % task):
        self.grad = tf.constant([1.0, 2.0]) * (task + 1)
        if impl is not support.STOCK:
          # Stock's first start, whose initial tokens the steps below take
          # (data_end="train_all" gives none then; a restart gives stock's
          # count either way).
          opt_kwargs.setdefault("data_end", "stock")
        self.opt = impl(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                        replicas_to_aggregate=2, total_num_replicas=2,
                        **opt_kwargs)
        self.train_op = self.opt.apply_gradients([(self.grad, self.v)],
                                                 global_step=self.global_step)
        self.init_tokens = (self.opt.get_init_tokens_op() if task == 0
                            else None)
        self.local_step = support.local_step_variable(self.graph)
        self.global_init = tf.compat.v1.global_variables_initializer()
        self.local_init = tf.compat.v1.local_variables_initializer()
    self.sess = tf.compat.v1.Session(cluster.worker_targets[task],
                                     graph=self.graph,
                                     config=support.session_config(10_000))

  def start_chief(self, *, first):
    if first:
      self.sess.run(self.global_init)
    self.sess.run(self.local_init)
    self.sess.run(self.opt.chief_init_op)
    self.sess.run(self.init_tokens)

  def start_worker(self):
    self.sess.run(self.local_init)
    self.sess.run(self.opt.local_step_init_op)

  def state(self):
    return self.sess.run({"accumulated": self.num_accumulated,
                          "tokens": self.tokens, "local": self.local_step})


def _crash_and_restart(impl):
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  chief = Replica(impl, cluster, 0)
  worker = Replica(impl, cluster, 1)
  chief.start_chief(first=True)
  worker.start_worker()
  worker.sess.run(worker.train_op)  # Fresh push at step 0; takes a token.
  assert worker.state() == {"accumulated": 1, "tokens": 1, "local": 0}
  # The chief dies here, its update never made. A new chief starts.
  chief.sess.close()
  chief = Replica(impl, cluster, 0)
  chief.start_chief(first=False)
  after_restart = worker.state()
  # The worker, still holding the token of the lost lifetime, pushes again.
  worker.sess.run(worker.train_op)
  return after_restart, worker.state()


def test_stock_restart_keeps_gradients_from_before_the_crash():
  after_restart, after_push = _crash_and_restart(support.STOCK)
  # The pre-crash gradient is still there, a leftover token was kept and R
  # more added, and the worker's push from the old token is accepted.
  assert after_restart["accumulated"] == 1
  assert after_restart["tokens"] == 3
  assert after_push["accumulated"] == 2


def test_our_restart_drops_every_gradient_from_before_the_crash():
  after_restart, after_push = _crash_and_restart(support.OURS)
  assert after_restart["accumulated"] == 0
  assert after_restart["tokens"] == 2  # Exactly the new initial tokens.
  # The old-lifetime push is stale now; the token it takes is new.
  assert after_push["accumulated"] == 0
  # Generation 1: the token carries step 0 plus one stride of 2**32.
  assert after_push["local"] == 1 << 32


def test_repeated_restarts_do_not_inflate_the_token_queue():
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  chief = Replica(support.OURS, cluster, 0)
  chief.start_chief(first=True)
  for _ in range(5):
    chief.sess.close()
    chief = Replica(support.OURS, cluster, 0)
    chief.start_chief(first=False)
    assert chief.state()["tokens"] == 2


def test_first_start_is_exactly_stock():
  """Generation 0: tokens and steps carry plain global-step values."""
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  chief = Replica(support.OURS, cluster, 0)
  with chief.graph.as_default():
    take_two = chief.opt.token_queue.dequeue_many(2)
  chief.start_chief(first=True)
  assert chief.sess.run(take_two).tolist() == [0, 0]


def test_int32_global_step_has_no_generation_but_is_cleared():
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  chief = Replica(support.OURS, cluster, 0, step_dtype=tf.int32)
  worker = Replica(support.OURS, cluster, 1, step_dtype=tf.int32)
  chief.start_chief(first=True)
  worker.start_worker()
  worker.sess.run(worker.train_op)
  chief.sess.close()
  chief = Replica(support.OURS, cluster, 0, step_dtype=tf.int32)
  chief.start_chief(first=False)
  assert worker.state()["accumulated"] == 0
  assert worker.state()["tokens"] == 2
  worker.sess.run(worker.train_op)
  assert worker.state()["local"] == 0  # Plain steps: no generation offset.


def test_a_restart_behind_the_accumulators_step_does_not_block():
  """A chief restored from an earlier checkpoint than the ps's state.

  The accumulator's step (5) is ahead of the restored global step (2), and
  int32 steps have no generation to lift the new steps above it. The
  accumulator is empty, so the clearing's take returns only once its own
  zero push is in: were that push dropped as stale, ``chief_init_op``
  would wait forever (here: fail at the session's 10 s op timeout).
  """
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  chief, worker = [Replica(support.OURS, cluster, t, step_dtype=tf.int32)
                   for t in (0, 1)]

  def set_step(replica, value):
    with replica.graph.as_default():
      replica.sess.run(tf.compat.v1.assign(replica.global_step, value))

  chief.sess.run(chief.global_init)
  set_step(chief, 5)
  chief.start_chief(first=False)
  worker.start_worker()
  assert worker.state() == {"accumulated": 0, "tokens": 2, "local": 5}
  chief.sess.close()
  chief = Replica(support.OURS, cluster, 0, step_dtype=tf.int32)
  set_step(chief, 2)  # What restoring an earlier checkpoint does.
  chief.start_chief(first=False)
  assert worker.state()["accumulated"] == 0
  worker.start_worker()
  worker.sess.run(worker.train_op)  # Fresh at the restored step: kept.
  assert worker.state() == {"accumulated": 1, "tokens": 1, "local": 2}


def test_one_gradient_per_worker_resumes_after_a_chief_restart():
  """Both replicas blocked for a token when the chief dies; none is lost.

  Each pushed at step 0 and waits for a token newer than 0. The restarted
  chief clears their gradients and gives each worker queue a token of the
  new generation; the worker pushes again and the chief pushes its first
  gradient, both fresh, and the next update averages exactly those two.
  """
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  chief, worker = [Replica(support.OURS, cluster, t,
                           one_gradient_per_worker=True, worker_index=t)
                   for t in range(2)]
  chief.start_chief(first=True)
  worker.start_worker()
  blocked = [support.BoundedThread(r.sess.run, r.train_op, name="push-%d" % i)
             for i, r in enumerate((chief, worker))]
  for t in blocked:
    t.start()
  support.wait_until(lambda: worker.state()["accumulated"] == 2, timeout=20,
                     what="both pushes at step 0")
  # The chief dies before its update: its pending run is cancelled.
  chief.sess.close()
  try:
    blocked[0].finish(timeout=20)
  except tf.errors.CancelledError:
    pass
  chief = Replica(support.OURS, cluster, 0, one_gradient_per_worker=True,
                  worker_index=0)
  chief.start_chief(first=False)
  assert worker.state()["accumulated"] == 0
  # The worker's wait ends with the new generation's token; it pushes again.
  blocked[1].finish(timeout=20)
  assert worker.state()["local"] == 1 << 32
  # The new chief's first push is fresh too: its local step is generation
  # 1's, as a starting replica's is the global step with stock.
  assert chief.state()["local"] == 1 << 32
  second = [support.BoundedThread(worker.sess.run, worker.train_op,
                                  name="worker-again"),
            support.BoundedThread(chief.sess.run, chief.train_op,
                                  name="chief-again")]
  for t in second:
    t.start()
  support.wait_until(lambda: worker.state()["accumulated"] == 2, timeout=20,
                     what="two fresh pushes after the restart")
  sync_op = chief.opt.get_chief_queue_runner().enqueue_ops[0]
  chief.sess.run(sync_op)
  for t in second:
    t.finish(timeout=20)
  step, v = chief.sess.run([chief.global_step, chief.v])
  assert step == 1
  # The mean of one gradient per replica: ([1, 2] + [2, 4]) / 2.
  np.testing.assert_allclose(v, [-1.5, -3.0])


@pytest.mark.parametrize("impl", [support.STOCK, support.OURS],
                         ids=["stock", "ours"])
def test_replicas_that_start_after_a_chief_restart_push_fresh_gradients(impl):
  # Stock sets a starting replica's local step to the global step, so its
  # first gradient counts. Ours must too in generation 1: the soak stalled
  # for good when the restarted chief's first push and a restarted worker's
  # were both one generation behind (stale, each needing a token to catch
  # up) and the init tokens had gone to a worker that then died.
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  chief = Replica(impl, cluster, 0)
  chief.start_chief(first=True)
  chief.sess.close()
  chief = Replica(impl, cluster, 0)  # The restart: generation 1 for ours.
  chief.start_chief(first=False)
  chief.sess.run(chief.train_op)
  assert chief.state()["accumulated"] == 1  # The chief's first push counts.
  worker = Replica(impl, cluster, 1)  # A worker (re)started after it.
  worker.start_worker()
  worker.sess.run(worker.train_op)
  assert worker.state()["accumulated"] == 2  # So does the worker's.
  if impl is support.OURS:
    # Their local steps are generation 1's: step 0 plus one stride.
    assert worker.state()["local"] == 1 << 32

"""Load invariants: 8 workers with random delays, checked gradient by gradient.

Each gradient encodes who pushed it and when: worker ``w`` at local step ``s``
pushes ``R * e[s, w]`` into a ``trace`` variable and ``R * e[w, k]`` (its k-th
push) into a ``pushes`` variable, with SGD at learning rate -1, so an applied
update adds exactly 1 to the cell of each gradient it averaged. At the end:

* ``trace[s].sum() == R`` for every step ``s`` below the global step: each
  update averaged only gradients computed at the step it moved from (fresh);
  rows from the global step on are 0;
* every ``pushes`` cell is 0 or R/k for the k >= R gradients its update
  averaged (1 when exactly R): no gradient was applied twice. (A take
  averages every fresh gradient present, so when more than R arrive before
  the chief asks, as stock allows, an update averages k > R of them.)
* the global step equals the number of updates; every thread ended.
"""

import random
import threading

import numpy as np
import pytest
import tensorflow as tf

import sync_replicas
import support

WORKERS = 8
LAST_STEP = 300
MAX_PUSHES = 1500


def _worker(cluster, task, replicas, ready, results):
  is_chief = task == 0
  graph = tf.Graph()
  with graph.as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      trace = tf.compat.v1.get_variable(
          "trace", [LAST_STEP + WORKERS + 2, WORKERS],
          initializer=tf.zeros_initializer())
      pushes = tf.compat.v1.get_variable(
          "pushes", [WORKERS, MAX_PUSHES], initializer=tf.zeros_initializer())
    with tf.compat.v1.device("/job:worker/task:%d" % task):
      push_index = tf.compat.v1.placeholder(tf.int32, [])
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(-1.0),
          replicas_to_aggregate=replicas, total_num_replicas=WORKERS)
      # The gradients are built from the local step, which apply_gradients
      # creates: build it, then read it through the public accessor.
      step_cell = tf.compat.v1.placeholder(tf.int32, [])
      worker_row = tf.one_hot(task, WORKERS) * replicas
      trace_grad = tf.tensordot(tf.one_hot(step_cell, LAST_STEP + WORKERS + 2),
                                worker_row, axes=0)
      pushes_grad = tf.tensordot(tf.one_hot(task, WORKERS),
                                 tf.one_hot(push_index, MAX_PUSHES) * replicas,
                                 axes=0)
      train_op = opt.apply_gradients(
          [(trace_grad, trace), (pushes_grad, pushes)],
          global_step=global_step)
      local_step = opt.local_step
    hooks = [opt.make_session_run_hook(is_chief),
             tf.compat.v1.train.StopAtStepHook(last_step=LAST_STEP)]
    rng = random.Random(task)
    runs = 0
    with support.monitored_session(
        "grpc://" + cluster.cluster_spec.task_address("worker", task),
        is_chief=is_chief, hooks=hooks, stop_grace_period_secs=120) as sess:
      if is_chief:
        ready.set()
      while not sess.should_stop():
        if runs >= MAX_PUSHES:
          raise AssertionError("worker %d pushed %d times" % (task, runs))
        # The gradient must carry the local step the push is checked with:
        # the step of this worker's last token (or the global step it
        # started at).
        step = sess.run(local_step)
        if sess.should_stop():  # That read may have seen the last step.
          break
        threading.Event().wait(rng.uniform(0, 0.004))
        sess.run(train_op, feed_dict={push_index: runs, step_cell: step})
        runs += 1
    results[task] = runs
  return graph


@pytest.mark.timeout(240)
@pytest.mark.scale(reason=(
    "8 workers for 300 steps with random delays (about 40 CPU-seconds): "
    "every update's exact average is proven at 2-3 workers, with backups, "
    "by test_parity and test_tf_scenarios in the default run"))
@pytest.mark.parametrize("replicas", [WORKERS, WORKERS - 2],
                         ids=["all_8", "6_of_8_with_2_backups"])
def test_every_update_averages_exactly_r_fresh_gradients(replicas):
  cluster = sync_replicas.LocalCluster(num_workers=WORKERS, num_ps=1)
  ready = threading.Event()
  results = {}
  threads = [support.BoundedThread(_worker, cluster, t, replicas, ready,
                                   results, name="worker%d" % t)
             for t in range(WORKERS)]
  threads[0].start()
  assert ready.wait(60), "the chief did not start"
  for t in threads[1:]:
    t.start()
  for t in threads:
    t.finish(timeout=180)
  assert sorted(results) == list(range(WORKERS))

  with tf.Graph().as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      trace = tf.compat.v1.get_variable("trace",
                                        [LAST_STEP + WORKERS + 2, WORKERS])
      pushes = tf.compat.v1.get_variable("pushes", [WORKERS, MAX_PUSHES])
    with tf.compat.v1.Session(cluster.worker_targets[0],
                              config=support.session_config()) as sess:
      step, trace_v, pushes_v = sess.run([global_step, trace, pushes])
  assert step >= LAST_STEP
  rows = trace_v.sum(axis=1)
  np.testing.assert_allclose(rows[:step], np.full(step, replicas), rtol=1e-5,
                             err_msg="an update with a stale gradient")
  np.testing.assert_array_equal(rows[step:], 0)
  applied = pushes_v[pushes_v != 0]
  averaged_over = replicas / applied  # k for each applied push
  np.testing.assert_allclose(averaged_over, np.round(averaged_over),
                             rtol=1e-4, err_msg="a gradient applied twice")
  assert (np.round(averaged_over) >= replicas).all(), (
      "a gradient applied twice")
  np.testing.assert_allclose(pushes_v.sum(), replicas * step, rtol=1e-5)
  # Every worker ran, and every applied push was one it made.
  for task, runs in results.items():
    assert runs >= 1
    assert pushes_v[task, runs:].sum() == 0

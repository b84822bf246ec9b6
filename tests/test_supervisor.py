"""The TF 0.12 Supervisor flow on two workers: ``Supervisor.stop()`` is prompt.

TensorFlow 0.12 documented SyncReplicasOptimizer with a Supervisor:
``local_init_op`` is ``chief_init_op`` on the chief and
``local_step_init_op`` elsewhere, ``ready_for_local_init_op`` guards it, the
chief starts the chief queue runner with ``start_queue_runners`` and runs
the init tokens op. ``test_legacy.test_supervisor_flow`` checks that flow's
numbers (closing the sessions before ``stop``, which sidesteps the wait) and
``test_shutdown.test_supervisor_stop_is_prompt`` the prompt stop on one
worker; this file runs the flow on a chief and a second worker and calls
``stop()`` as a user would, side by side with stock, whose chief waits the
whole ``stop_grace_secs`` (120 s by default; 3 s here) and then raises
because its queue-runner thread is still blocked.
"""

import time

import numpy as np
import pytest
import tensorflow as tf

import support
import sync_replicas

#: A stop that takes longer than this has waited for the grace period.
PROMPT_SECS = support.PROMPT_SECS
ROUNDS = 5


def _supervised(worker, *, grace):
  """Builds ``worker``'s Supervisor the 0.12 way; returns (sv, session)."""
  opt = worker.opt
  with worker.graph.as_default():
    init_tokens = opt.get_init_tokens_op() if worker.is_chief else None
    init_op = tf.compat.v1.global_variables_initializer()
    sv = tf.compat.v1.train.Supervisor(
        is_chief=worker.is_chief, logdir=None, init_op=init_op,
        local_init_op=(opt.chief_init_op if worker.is_chief
                       else opt.local_step_init_op),
        ready_for_local_init_op=opt.ready_for_local_init_op,
        recovery_wait_secs=0.2, global_step=worker.global_step,
        save_model_secs=0, save_summaries_secs=0, stop_grace_secs=grace)
    # Inside the graph: outside it TF 2 is eager, where queues refuse to run.
    sess = sv.prepare_or_wait_for_session(
        worker.target, config=support.session_config(), max_wait_secs=30)
    threads = []
    if worker.is_chief:
      threads = sv.start_queue_runners(sess, [opt.get_chief_queue_runner()])
      sess.run(init_tokens)
  return sv, sess, threads


def _train(impl, *, grace):
  """Two workers train ROUNDS rounds.

  Returns (workers, supervisors, sessions, the chief's runner threads).
  """
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  # Ours with stock's start (round 2 stale), as the rounds below count.
  extra = None if impl is support.STOCK else {"data_end": "stock"}
  workers = [support.LinearWorker(impl, cluster, t, replicas=2, total=2,
                                  opt_kwargs=extra)
             for t in range(2)]
  # The chief first: the other waits for its initialization.
  supervised = [_supervised(w, grace=grace) for w in workers]
  sessions = [sess for _, sess, _ in supervised]
  for _ in range(ROUNDS):
    support.run_concurrently(
        [(sess.run, w.train_op) for w, sess in zip(workers, sessions,
                                                        strict=True)])
  chief_sess = sessions[0]
  # Round 2 is stale (its tokens carried step 0): ROUNDS - 1 updates.
  support.wait_until(
      lambda: chief_sess.run(workers[0].global_step) == ROUNDS - 1,
      timeout=20, what="global_step == %d" % (ROUNDS - 1))
  return workers, [sv for sv, _, _ in supervised], sessions, supervised[0][2]


def test_two_worker_supervisor_stop_is_prompt():
  workers, svs, sessions, _ = _train(support.OURS,
                                     grace=support.STOCK_GRACE_SECS)
  try:
    for w, sess in zip(workers, sessions, strict=True):
      local = support.local_step_variable(w.graph)
      assert sess.run(local) == ROUNDS - 1  # Each took the newest token.
    assert not np.array_equal(sessions[0].run(workers[0].w), np.zeros(4))
    svs[1].stop()
    start = time.monotonic()
    svs[0].stop()  # The chief's; default-sized grace: 120 s.
    stop_secs = time.monotonic() - start
    assert stop_secs < PROMPT_SECS, (
        "Supervisor.stop() took %.1fs: it waited for the grace period or an "
        "op timeout"
        % stop_secs)
  finally:
    for sess in reversed(sessions):
      sess.close()


# Closing the session ends stock's blocked thread with a CancelledError
# traceback: its known behaviour, not this test's failure.
@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_stock_supervisor_stop_waits_the_grace_and_raises():
  workers, svs, sessions, threads = _train(support.STOCK, grace=3)
  del workers
  try:
    support.wait_for_stock_runner_to_block(threads)
    svs[1].stop()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="threads still running"):
      svs[0].stop()
    assert time.monotonic() - start >= 2.5
  finally:
    for sess in reversed(sessions):
      sess.close()

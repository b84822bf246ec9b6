"""TensorFlow's own two SyncReplicasOptimizer scenarios, with their exact values.

Rewritten from tensorflow/python/training/sync_replicas_optimizer_test.py and
run with both stock's class and ours, each on a fresh in-process cluster.
"""

import numpy as np
import pytest

import support

pytestmark = pytest.mark.quick  # In ./tools/test --quick.


def assert_close(actual, expected):
  # float32 variables against float64 expectations: TF's assertAllClose rtol.
  np.testing.assert_allclose(actual, expected, rtol=1e-6)


def test_two_workers_aggregating_two(impl):
  workers = support.make_tf_test_workers(impl, num_workers=2,
                                         replicas_to_aggregate=2)
  w0, w1 = workers
  try:
    gs, v0, v1, v_sparse, local = w1.read()
    assert (gs, v0, v1, local) == (0, 0.0, 1.0, 0)
    assert_close(v_sparse, [[3.0], [4.0]])
    assert w0.read()[4] == 0

    # Initial tokens let the two steps run one after the other.
    w0.step()
    w1.step()
    support.wait_until(lambda: w1.read()[0] == 1, timeout=20,
                       what="global_step == 1")
    gs, v0, v1, v_sparse, _ = w1.read()
    assert_close(v0, 0 - (0.1 + 0.3) / 2 * 2.0)  # -0.4
    assert_close(v1, 1 - (0.9 + 1.1) / 2 * 2.0)  # -1.0
    assert_close(v_sparse, [[3.0], [4.0 - 0.4]])
    # The initial tokens carried step 0, so both local steps are still 0.
    assert w0.read()[4] == 0 and w1.read()[4] == 0

    # Both gradients of this round are stale and dropped; local steps move.
    w0.step()
    w1.step()
    gs, v0, v1, _, local1 = w1.read()
    assert (gs, local1, w0.read()[4]) == (1, 1, 1)
    assert_close(v0, -0.4)
    assert_close(v1, -1.0)

    # The token queue is empty now: the two must step together.
    support.run_concurrently([(w0.step,), (w1.step,)])
    gs, v0, v1, _, _ = w1.read()
    assert gs == 2
    assert_close(v0, -0.8)
    assert_close(v1, -3.0)
  finally:
    support.close_all(workers)


def test_three_workers_one_backup(impl):
  workers = support.make_tf_test_workers(impl, num_workers=3,
                                         replicas_to_aggregate=2)
  w0, w1, w2 = workers
  try:
    assert w1.read()[0] == 0 and w1.read()[4] == 0
    # Workers 0 and 2 finish first; their two gradients make the update.
    w0.step()
    w2.step()
    support.wait_until(lambda: w1.read()[0] == 1, timeout=20,
                       what="global_step == 1")
    _, v0, v1, _, _ = w1.read()
    assert_close(v0, 0 - (0.1 + 0.5) / 2 * 2.0)  # -0.6
    assert_close(v1, 1 - (0.9 + 1.3) / 2 * 2.0)  # -1.2

    # Worker 1 is late: its gradient is stale and dropped. So is everyone's
    # next one, computed with local step 0.
    w1.step()
    w0.step()
    w1.step()
    w2.step()
    gs, v0, _, _, local1 = w1.read()
    assert (gs, local1) == (1, 1)
    assert_close(v0, -0.6)

    t0 = support.BoundedThread(w0.step, name="worker0")
    t0.start()
    # One gradient is not enough for an update: once worker 0's is in, the
    # step stays and the gradient waits in the accumulator (a take would
    # have emptied it before the step moves).
    support.wait_until(lambda: w1.session.run(w1.v0_pending) >= 1,
                       timeout=20, what="worker 0's push")
    assert w1.session.run([w1.global_step, w1.v0_pending]) == [1, 1]
    t1 = support.BoundedThread(w1.step, name="worker1")
    t1.start()
    t1.finish()
    t0.finish()
    gs, v0, v1, _, _ = w1.read()
    assert gs == 2
    assert_close(v0, -0.6 - (0.1 + 0.3) / 2 * 2.0)
    assert_close(v1, -1.2 - (0.9 + 1.1) / 2 * 2.0)
  finally:
    support.close_all(workers)

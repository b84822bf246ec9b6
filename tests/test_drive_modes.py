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
    opt = impl(tf.compat.v1.train.GradientDescentOptimizer(0.1),
               replicas_to_aggregate=1, total_num_replicas=1)
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

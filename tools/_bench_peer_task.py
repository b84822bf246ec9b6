"""One worker of tools/bench's MultiWorkerMirroredStrategy peer.

The alternative TensorFlow's deprecation notice points this class's users to:
``tf.distribute.MultiWorkerMirroredStrategy`` (MWMS), every worker holding
every variable and the gradients all-reduced, no ps. ``python
tools/_bench_peer_task.py --serve SPEC_JSON`` sets this process's TF_CONFIG
from SPEC (a ``ServeSpec`` with ``communication``: ``AUTO``, MWMS's default,
or ``RING``), creates the strategy once, writes ``{"up": ...}`` and serves
runs with the protocol of tools/_bench_task.py (``run``, then ``start``;
no ``go``: nothing here waits for a chief's initialization).

A run builds the scenario's model (the same variables, shapes, per-worker
batch and plain SGD as the graph-mode tasks, ``peer_model``) under the
strategy's scope, and trains it with a custom loop: a ``tf.function`` step
that computes the gradients on the worker's batch, all-reduces them (their
mean, one batched call) and subtracts ``rate * mean`` from every mirror.
One step of every worker is one update of the job, so the global step is
the step count. The run ends as the graph-mode runs end: worker 0 picks a
last step a little ahead and writes it to the stop file, every worker stops
there (collectives need every worker to take the same number of steps).
"""

import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

# This file runs as a script, so its folder (tools/) is sys.path[0].
import _bench_protocol as protocol  # pylint: disable=g-import-not-at-top
import _bench_task as task_lib  # pylint: disable=g-import-not-at-top
import _peak_rss as peak_rss  # pylint: disable=g-import-not-at-top

#: The learning rate of every implementation's plain SGD.
RATE = 0.001


def _glorot(rng, shape):
  limit = np.sqrt(6.0 / (shape[0] + shape[1]))
  return rng.uniform(-limit, limit, size=shape).astype(np.float32)


def peer_model(scenario, rng):
  """``(variables, batch, loss_fn)``: the scenario's model, eagerly.

  ``loss_fn(variables, batch)`` is the loss; shapes, initial values' kinds
  and batches follow tools/_bench_task.py's ``build_model``.
  """
  def linear(count, size):
    variables = [tf.Variable(tf.zeros([size]), name="v%d" % i)
                 for i in range(count)]
    batch = [tf.constant(rng.normal(size=[size]).astype(np.float32))
             for _ in range(count)]
    loss = lambda vs, xs: tf.add_n(
        [tf.reduce_sum(v * x) for v, x in zip(vs, xs, strict=True)])
    return variables, batch, loss

  if scenario in ("small", "straggler"):
    return linear(10, 100)
  if scenario in task_lib.MANY:
    return linear(task_lib.MANY[scenario], 100)
  if scenario == "flat":
    return linear(1, 20_000)
  if scenario in task_lib.STACKED:
    count, size, examples = task_lib.STACKED[scenario]
    variables = [tf.Variable(tf.zeros([size]), name="v%d" % i)
                 for i in range(count)]
    batch = [tf.constant(rng.normal(size=(examples, count)).astype(
        np.float32)), tf.constant(rng.normal(size=(examples, size)).astype(
            np.float32))]

    def stacked_loss(vs, xs):
      x, target = xs
      hidden = tf.tanh(tf.matmul(x, tf.stack(vs)))
      return tf.reduce_mean(tf.square(hidden - target))
    return variables, batch, stacked_loss
  if scenario in task_lib.MLPS or scenario in task_lib.SPLIT:
    # Without a ps there is nothing to split a matrix over: the same MLP.
    sizes, examples = task_lib.MLPS[task_lib.SPLIT.get(scenario, scenario)]
    variables = []
    # Each layer's width with the next's (strict=False: the last, the
    # output's, has none).
    for a, b in zip(sizes, sizes[1:], strict=False):
      variables += [tf.Variable(_glorot(rng, [a, b])), tf.Variable(
          tf.zeros([b]))]
    batch = [tf.constant(rng.normal(size=(examples, sizes[0])).astype(
        np.float32)), tf.constant(rng.integers(0, 10, size=examples))]

    def mlp_loss(vs, xs):
      h, labels = xs
      for i in range(0, len(vs), 2):
        h = tf.matmul(h, vs[i]) + vs[i + 1]
        if i + 2 < len(vs):
          h = tf.nn.relu(h)
      return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=h))
    return variables, batch, mlp_loss
  if scenario == "sparse":
    table = tf.Variable(_glorot(rng, [100_000, 64]))
    ids = tf.constant(rng.integers(0, 100_000, size=128))
    return [table], [ids], lambda vs, xs: tf.reduce_sum(
        tf.nn.embedding_lookup(vs[0], xs[0]))
  raise ValueError("no peer model for scenario %r" % scenario)


def _sgd_step(strategy, variables, batch, loss_fn):
  """The tf.function of one synchronous step of this worker."""

  def apply(distribution, grads):
    for var, grad in zip(variables, grads, strict=True):
      distribution.extended.update(var, _subtract, args=(grad,), group=False)

  def replica_step(xs):
    with tf.GradientTape() as tape:
      loss = loss_fn(variables, xs)
    grads = tape.gradient(loss, variables)
    context = tf.distribute.get_replica_context()
    grads = context.all_reduce(tf.distribute.ReduceOp.MEAN, grads)
    context.merge_call(apply, args=(grads,))
    return loss

  @tf.function
  def step(xs):
    return strategy.run(replica_step, args=(xs,))
  return step


def _subtract(var, grad):
  if isinstance(grad, tf.IndexedSlices):
    return var.scatter_sub(tf.IndexedSlices(grad.values * RATE, grad.indices,
                                            grad.dense_shape))
  return var.assign_sub(grad * RATE)


def train(strategy, spec, task, *, session_ready, wait_start):
  """One run of ``spec`` (a protocol.RunSpec); returns the record."""
  rng = np.random.default_rng(task)
  peak_rss.reset()
  began = time.monotonic()
  with strategy.scope():
    variables, batch, loss_fn = peer_model(spec.scenario, rng)
  step_fn = _sgd_step(strategy, variables, batch, loss_fn)
  built = time.monotonic()
  session_ready()
  wait_start()
  started = time.monotonic()
  latencies, steps_at, cpu_at = [], [], []
  first_step = cpu_at_first = deadline = None
  last_step = None
  step = 0
  delay = (spec.straggler_delay
           if task == len(spec.cluster["worker"]) - 1 else 0.0)
  while last_step is None or step < last_step:
    if last_step is None and os.path.exists(spec.stop_file):
      last_step = task_lib.read_stop(spec.stop_file)
      continue
    if delay:
      time.sleep(delay)
    start = time.monotonic()
    step_fn(batch)
    end = time.monotonic()
    step += 1
    if first_step is None:
      first_step = time.time()
      cpu_at_first = task_lib.cpu_snapshot(spec.pool_pids)
      if task == 0:
        deadline = end + spec.warmup + spec.secs
    latencies.append(end - start)
    steps_at.append((end, step))
    cpu_at.append(time.process_time())
    if deadline is not None and end >= deadline and last_step is None:
      # The others are at most one step apart: they all reach this one.
      last_step = step + 2
      task_lib.write_stop(spec.stop_file, last_step)
  left = time.monotonic()
  cpu_at_last = task_lib.cpu_snapshot(spec.pool_pids)
  return {
      "first_global_step": 1, "task": task, "runs": len(latencies),
      "latencies": latencies, "steps_at": steps_at, "cpu_at": cpu_at,
      "first_step_wall": first_step, "close_secs": 0.0,
      "peak_rss_mb": peak_rss.peak_mb(), "build_secs": built - began,
      "wait_secs": 0.0, "session_secs": 0.0,
      "start_secs": started - built, "train_secs": left - started,
      "read_ms_p50": None,
      "other_cores": task_lib.other_cores(cpu_at_first, cpu_at_last),
      "job_cpu_secs": task_lib.job_cpu_secs(cpu_at_first, cpu_at_last),
      "task_cpu_secs": task_lib.task_cpu_secs(cpu_at_first, cpu_at_last,
                                              spec.cluster),
      "optimizer_options": {"communication": spec.impl},
      # What each worker's all-reduce moves per step (tools/linkcost's
      # floor): every variable, replicated on every worker.
      "model_bytes": sum(v.shape.num_elements() * v.dtype.size
                         for v in variables),
  }


def serve(spec):
  """Serves ``spec`` (a protocol.ServeSpec) until ``exit`` or stdin's end."""
  channel = task_lib.Channel()
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": spec.cluster,
      "task": {"type": spec.job, "index": spec.task}})
  experimental = tf.distribute.experimental
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=experimental.CommunicationOptions(
          implementation=getattr(experimental.CommunicationImplementation,
                                 spec.communication)))
  channel.send({protocol.UP: "mwms", protocol.PID: os.getpid()})
  while True:
    command = channel.receive()
    if command[protocol.CMD] == protocol.EXIT:
      break
    if command[protocol.CMD] != protocol.RUN:
      continue

    def expect(what):
      command = channel.receive()
      if command[protocol.CMD] != what:
        raise RuntimeError("expected %r, got %r" % (what, command))

    try:
      record = train(strategy, protocol.run_spec(command), spec.task,
                     session_ready=lambda: channel.send({protocol.READY: True}),
                     wait_start=lambda: expect(protocol.START))
    except Exception:  # pylint: disable=broad-except
      channel.send({protocol.ERROR: traceback.format_exc()})
    else:
      channel.send({protocol.DONE: record})
  sys.stderr.flush()
  # The strategy's server cannot be stopped; leave without its destructor.
  os._exit(0)  # pylint: disable=protected-access


def main(argv):
  if len(argv) != 3 or argv[1] != "--serve":
    print(__doc__, file=sys.stderr)
    return 2
  serve(protocol.serve_spec(argv[2]))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))

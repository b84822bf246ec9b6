#!/usr/bin/env python3
"""Loss curves and accuracy with ``transfer_dtype`` against float32 (issue 45).

Trains two models on real data, scikit-learn's bundled 8x8 digits (the
examples' data and split, ``examples/_digits.py``), on an in-process cluster
of one ps and two workers, once per transfer dtype (float32, bfloat16,
float16) from the same seed, and prints the test loss and accuracy every
``--every`` updates as markdown tables, then each dtype's largest
difference from float32.

The workers step in lockstep (both run a step, the update lands, then the
next pair): every update averages one gradient of each worker, so the
schedule, and with it float32's numbers, is the same in every run, and the
runs differ only by what the wire rounds.

  digits: the examples' model (64 pixels, 64 ReLU, 10), Adam 0.01, batch 32
  mlp:    tools/bench's MLP, 784-256-256-10, on the digits upsampled to
          28x28 (each pixel 3x3, padded), Adam 0.001, batch 32

Every run has ``fuse_dense_gradients`` and ``pack_variable_reads`` on, so
the gradients and the model's reads both cross in the dtype; the test
numbers are computed by worker 0's graph, from the reads it gets.

Usage (from the checkout, in the venv tools/test made):

  .venv/bin/python tools/transfer_dtype_evidence.py [--steps 600] [--every 100]
"""

import argparse
import concurrent.futures
import pathlib
import sys

import numpy as np
import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sync_replicas  # pylint: disable=wrong-import-position
from examples import _digits  # pylint: disable=wrong-import-position

DTYPES = ("float32", "bfloat16", "float16")
WORKERS = 2
#: No step may take longer (a lost task fails the run instead of hanging it).
STEP_SECS = 60


def _upsampled(x):
  """8x8 digits as 28x28 images: each pixel 3x3, 2 pixels of border."""
  images = x.reshape(-1, 8, 8)
  big = np.kron(images, np.ones((3, 3), np.float32))
  return np.pad(big, ((0, 0), (2, 2), (2, 2))).reshape(-1, 784)


def _mlp_logits(x):
  init = tf.compat.v1.glorot_uniform_initializer
  h = x
  sizes = [784, 256, 256, 10]
  for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
    w = tf.compat.v1.get_variable("w%d" % i, [a, b], initializer=init(seed=i))
    bias = tf.compat.v1.get_variable("b%d" % i, [b],
                                     initializer=tf.zeros_initializer())
    h = tf.matmul(h, w) + bias
    if i + 2 < len(sizes):
      h = tf.nn.relu(h)
  return h


MODELS = {
    "digits": dict(features=64, logits=_digits.logits_fn, rate=0.01,
                   inputs=lambda x: x),
    "mlp": dict(features=784, logits=_mlp_logits, rate=0.001,
                inputs=_upsampled),
}


class _Worker:

  def __init__(self, model, cluster, task, dtype):
    spec = MODELS[model]
    data = _digits.load(replica_index=task, num_replicas=WORKERS)
    self.test = (spec["inputs"](data.x_test), data.y_test)
    self.batches = _digits.Batches(spec["inputs"](data.x_train),
                                   data.y_train, batch_size=32, seed=task)
    self.graph = tf.Graph()
    with self.graph.as_default(), tf.compat.v1.device(
        tf.compat.v1.train.replica_device_setter(
            cluster=cluster.cluster_spec,
            worker_device="/job:worker/task:%d" % task)):
      step = tf.compat.v1.train.get_or_create_global_step()
      self.x = tf.compat.v1.placeholder(tf.float32, [None, spec["features"]])
      self.y = tf.compat.v1.placeholder(tf.int64, [None])
      self.loss, self.accuracy = _digits.loss_and_accuracy(
          spec["logits"](self.x), self.y)
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.AdamOptimizer(spec["rate"]),
          replicas_to_aggregate=WORKERS, fuse_dense_gradients=True,
          pack_variable_reads=True, transfer_dtype=dtype)
      self.train_op = opt.minimize(self.loss, global_step=step)
      hook = opt.make_session_run_hook(task == 0)
    with self.graph.as_default():  # The hook builds its ops in begin().
      self.session = tf.compat.v1.train.MonitoredTrainingSession(
          master=cluster.worker_targets[task], is_chief=task == 0,
          hooks=[hook], config=tf.compat.v1.ConfigProto(
              operation_timeout_in_ms=STEP_SECS * 1000),
          stop_grace_period_secs=1, save_summaries_steps=None,
          save_summaries_secs=None, log_step_count_steps=None)

  def step(self):
    xs, ys = self.batches.next()
    self.session.run(self.train_op, feed_dict={self.x: xs, self.y: ys})

  def evaluate(self):
    return self.session.run_step_fn(
        lambda step_context: step_context.session.run(
            [self.loss, self.accuracy],
            feed_dict={self.x: self.test[0], self.y: self.test[1]}))


def train(model, cluster, dtype, *, steps, every):
  """``[(update, test loss, test accuracy), ...]`` of one run."""
  for target in cluster.worker_targets:
    tf.compat.v1.Session.reset(target)  # Fresh variables and accumulators.
  workers = []
  curve = []
  with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
    try:
      for task in range(WORKERS):  # The chief first: it initializes.
        workers.append(_Worker(model, cluster, task, dtype))
      curve.append((0, *workers[0].evaluate()))
      for update in range(1, steps + 1):
        for done in [pool.submit(w.step) for w in workers]:
          done.result(timeout=STEP_SECS)
        if update % every == 0:
          curve.append((update, *workers[0].evaluate()))
    finally:
      for w in reversed(workers):
        w.session.close()
  return curve


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--every", type=int, default=100)
  parser.add_argument("--models", default="digits,mlp")
  args = parser.parse_args(argv)
  tf.compat.v1.disable_eager_execution()
  cluster = sync_replicas.LocalCluster(num_workers=WORKERS, num_ps=1)
  for model in args.models.split(","):
    curves = {d: train(model, cluster, d, steps=args.steps, every=args.every)
              for d in DTYPES}
    print("\n%s: test loss / test accuracy by update\n" % model)
    print("| update | " + " | ".join(DTYPES) + " |")
    print("|---|" + "---|" * len(DTYPES))
    for i, (update, _, _) in enumerate(curves["float32"]):
      print("| %d | " % update + " | ".join(
          "%.4f / %.4f" % curves[d][i][1:] for d in DTYPES) + " |")
    for d in DTYPES[1:]:
      loss = max(abs(a[1] - b[1])
                 for a, b in zip(curves[d], curves["float32"], strict=True))
      accuracy = abs(curves[d][-1][2] - curves["float32"][-1][2])
      print("\n%s %s: largest test-loss difference from float32 %.4f; final "
            "accuracy difference %.4f" % (model, d, loss, accuracy))
  return 0


if __name__ == "__main__":
  sys.exit(main())

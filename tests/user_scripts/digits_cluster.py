"""What the training scripts in this folder share: flags, data, model, waits.

None of it drives training: each script builds its own optimizer and runs
its own pattern (see docs/user_scripts.md). Everything here is plain
TensorFlow, as a stock user's project would hold it.

* Flags: the TF1 cluster flags (--ps_hosts, --worker_hosts, --job_name,
  --task_index; worker 0 is the chief) and the training length.
* Data: scikit-learn's bundled 8x8 digits through ``examples._digits`` (read
  from its data file, no download, no ``import sklearn``), each worker on its
  own shard.
* Model: softmax regression, 64 pixels -> 10 classes, zero-initialized, so
  the first loss is ln(10) in every run.
* ``serve``: a ps task's bounded stand-in for ``server.join()``.
* ``wait_for_chief``: a non-chief's own short poll for the chief's init.
  TensorFlow's session managers look once, then sleep 30 s before looking
  again (Supervisor's default recovery_wait_secs; MonitoredTrainingSession,
  tf-slim and Estimator offer no knob), so a worker that starts with the
  chief would nap through most of a short run.
"""

import sys
import time

import numpy as np
import tensorflow as tf

from examples import _digits

#: No op of these scripts may block longer than this: a lost peer becomes an
#: error, not a hang.
OP_TIMEOUT_MS = 60_000
#: The longest a ps task serves. Its harness kills it when its test ends
#: (test_user_scripts also runs every task under ``timeout --signal=KILL``,
#: the longest test's timeout); this bound holds without a harness too.
PS_SERVE_SECS = 900
#: How often and how long a non-chief polls for the chief's init.
POLL_SECS = 0.2
WAIT_FOR_CHIEF_SECS = 300


def add_flags(parser, *, train_steps=300, learning_rate=0.5):
  parser.add_argument("--ps_hosts", required=True,
                      help="comma-separated host:port of the ps tasks")
  parser.add_argument("--worker_hosts", required=True,
                      help="comma-separated host:port of the workers")
  parser.add_argument("--job_name", choices=["ps", "worker"], required=True)
  parser.add_argument("--task_index", type=int, default=0,
                      help="this task's index in its job; worker 0 is chief")
  parser.add_argument("--train_steps", type=int, default=train_steps,
                      help="global step at which training stops")
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--learning_rate", type=float, default=learning_rate)
  parser.add_argument("--logdir", default="/tmp/digits_cluster",
                      help="the chief's checkpoints and summaries")


def cluster_spec(args):
  return tf.train.ClusterSpec({"ps": args.ps_hosts.split(","),
                               "worker": args.worker_hosts.split(",")})


def start_server(args):
  """This task's server; a ps task serves here until it is killed."""
  server = tf.distribute.Server(cluster_spec(args), job_name=args.job_name,
                                task_index=args.task_index)
  if args.job_name == "ps":
    serve(server, args.task_index)
  return server


def serve(server, task_index):
  """A ps task's life: serve until killed, and at most PS_SERVE_SECS.

  The scripts these stand for call ``server.join()``, which has no timeout
  and never returns. The server's own threads serve whatever this thread
  does, so a bounded sleep serves the same and ends by itself: the exit
  (code 1, saying why) is what a ps nobody stopped should do.
  """
  print("ps %d serving" % task_index, flush=True)
  time.sleep(PS_SERVE_SECS)
  sys.exit("ps %d: not stopped within PS_SERVE_SECS=%s s; exiting"
           % (task_index, PS_SERVE_SECS))


def worker_device(args):
  return "/job:worker/task:%d" % args.task_index


def session_config(args):
  """Sees the ps tasks and this worker only, and bounds every op.

  Without the filters a worker's session would wait for every other task's
  server, and could not start once another worker had exited.
  """
  return tf.compat.v1.ConfigProto(
      device_filters=["/job:ps", worker_device(args)],
      operation_timeout_in_ms=OP_TIMEOUT_MS)


def shard(args):
  """This worker's training images and labels (float32 rows, int64)."""
  num_workers = len(args.worker_hosts.split(","))
  data = _digits.load(replica_index=args.task_index, num_replicas=num_workers)
  return data.x_train, data.y_train


def batches(images, labels, *, batch_size, seed):
  """Endless random mini-batches."""
  rng = np.random.default_rng(seed)
  while True:
    rows = rng.integers(len(images), size=batch_size)
    yield images[rows], labels[rows]


def softmax_loss(images, labels):
  """Mean cross-entropy of a zero-initialized softmax regression."""
  weights = tf.compat.v1.get_variable(
      "softmax/weights", [_digits.NUM_FEATURES, _digits.NUM_CLASSES],
      initializer=tf.compat.v1.zeros_initializer())
  biases = tf.compat.v1.get_variable(
      "softmax/biases", [_digits.NUM_CLASSES],
      initializer=tf.compat.v1.zeros_initializer())
  logits = tf.matmul(images, weights) + biases
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


def describe(optimizer):
  """The line every script logs once its optimizer is built."""
  print("optimizer: %s.%s" % (type(optimizer).__module__,
                              type(optimizer).__name__), flush=True)


def log_step(args, step, loss):
  print("worker %d: global step %d, loss %.4f" % (args.task_index, step, loss),
        flush=True)


def log_final(args, step):
  print("worker %d: final global step %d" % (args.task_index, step),
        flush=True)


def wait_for_chief(target, config):
  """Polls until the chief has initialized the model's variables, every
  POLL_SECS for at most WAIT_FOR_CHIEF_SECS.

  Looks at the global variables of the default graph, which must not be
  finalized yet: this worker's local ones (the optimizer's local step among
  them) are its session manager's to initialize, after this wait. The wait
  ends when the chief's init op has run; it fails, naming what it waited
  for, if the chief never runs it.
  """
  uninitialized = tf.compat.v1.report_uninitialized_variables(
      tf.compat.v1.global_variables())
  print("waiting for the chief to initialize the model", flush=True)
  deadline = time.monotonic() + WAIT_FOR_CHIEF_SECS
  with tf.compat.v1.Session(target, config=config) as sess:
    while len(sess.run(uninitialized)):  # pylint: disable=g-explicit-length-test
      if time.monotonic() > deadline:
        raise SystemExit("the chief did not initialize the model within "
                         "%d s" % WAIT_FOR_CHIEF_SECS)
      time.sleep(POLL_SECS)

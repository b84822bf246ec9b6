"""The digits data and classifier shared by the digits examples.

Owns loading scikit-learn's bundled 8x8 digits (1797 images, shipped inside
the package: no download), the fixed train/test split, each replica's shard of
the training set, and the plain TensorFlow model. Nothing here is specific to
sync_replicas.

The digits are read from scikit-learn's own data file, found through the
package's metadata, without importing ``sklearn``: importing it (SciPy
included) costs about a second of CPU even after TensorFlow's import, in each
process that loads the digits.
"""

import collections
import gzip
import importlib.metadata

import numpy as np
import tensorflow as tf

NUM_CLASSES = 10
NUM_FEATURES = 64

Data = collections.namedtuple(
    "Data", ["x_train", "y_train", "x_test", "y_test"])

#: The file ``sklearn.datasets.load_digits`` reads, relative to the folder
#: scikit-learn is installed in (site-packages).
DIGITS_FILE = "sklearn/datasets/data/digits.csv.gz"
_MISSING = ("The digits examples need scikit-learn (its bundled digits data): "
            "pip install scikit-learn, or pip install -e '.[examples]'.")


def digits_file():
  """The path of scikit-learn's bundled digits, found without importing it."""
  try:
    dist = importlib.metadata.distribution("scikit-learn")
  except importlib.metadata.PackageNotFoundError:
    raise SystemExit(_MISSING) from None
  path = dist.locate_file(DIGITS_FILE)
  if not path.is_file():
    raise SystemExit("scikit-learn %s is installed, but its digits data is "
                     "not at %s: reinstall it (pip install --force-reinstall "
                     "scikit-learn)." % (dist.version, path))
  return path


def load_digits():
  """``(data, target)``, as ``sklearn.datasets.load_digits(return_X_y=True)``.

  Parsed as scikit-learn 1.x parses the file: gzip'd UTF-8 CSV, float64 rows
  of 64 pixels (0-16) then the label; the label column cast to int.
  tests/test_examples.py checks the arrays are bit-identical to sklearn's.
  """
  with gzip.open(digits_file(), "rt", encoding="utf-8") as f:
    data = np.loadtxt(f, delimiter=",")
  return data[:, :-1], data[:, -1].astype(int, copy=False)


def load(*, replica_index=0, num_replicas=1, test_fraction=0.2):
  """Loads the digits; the training part is this replica's shard only.

  The split is the same in every process (a fixed permutation), so no test
  image is ever trained on by any replica.
  """
  data, target = load_digits()
  x = (data / 16.0).astype(np.float32)
  y = target.astype(np.int64)
  order = np.random.default_rng(0).permutation(len(x))
  num_test = int(len(x) * test_fraction)
  test, train = order[:num_test], order[num_test:]
  shard = train[replica_index::num_replicas]
  return Data(x[shard], y[shard], x[test], y[test])


def logits_fn(x, *, hidden=64):
  """A one-hidden-layer perceptron: 64 pixels -> ``hidden`` ReLU -> 10."""
  w1 = tf.compat.v1.get_variable(
      "hidden/weights", [NUM_FEATURES, hidden],
      initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  b1 = tf.compat.v1.get_variable("hidden/biases", [hidden],
                                 initializer=tf.zeros_initializer())
  w2 = tf.compat.v1.get_variable(
      "softmax/weights", [hidden, NUM_CLASSES],
      initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  b2 = tf.compat.v1.get_variable("softmax/biases", [NUM_CLASSES],
                                 initializer=tf.zeros_initializer())
  return tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2


def loss_and_accuracy(logits, labels):
  loss = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                     logits=logits))
  correct = tf.equal(tf.argmax(logits, axis=1), labels)
  return loss, tf.reduce_mean(tf.cast(correct, tf.float32))


class Batches:
  """Endless shuffled mini-batches of one replica's shard."""

  def __init__(self, x, y, *, batch_size, seed):
    self._x, self._y = x, y
    self._batch_size = min(batch_size, len(x))
    self._rng = np.random.default_rng(seed)
    self._order = np.empty(0, np.int64)

  def next(self):
    if len(self._order) < self._batch_size:
      self._order = np.concatenate(
          [self._order, self._rng.permutation(len(self._x))])
    take, self._order = (self._order[:self._batch_size],
                         self._order[self._batch_size:])
    return self._x[take], self._y[take]

"""Stand-in for ``tensorflow.examples.tutorials.mnist.input_data``.

Serves scikit-learn's bundled 8x8 digits (no download) through the slice of
that module's interface ``mnist_replica.py`` uses: ``read_data_sets(data_dir,
one_hot=True)`` returning ``.train.next_batch(n)`` and ``.validation.images``
/ ``.validation.labels``, images as flat float32 rows in [0, 1] and labels
one-hot, as the original served MNIST. The train part is the digits
examples' training split, the validation part their test split.
"""

import collections

import numpy as np

from examples import _digits

Datasets = collections.namedtuple("Datasets", ["train", "validation"])


class DataSet:
  """Images and one-hot labels; ``next_batch`` walks a reshuffled epoch."""

  def __init__(self, images, labels, *, seed):
    self.images = images
    self.labels = np.eye(_digits.NUM_CLASSES, dtype=np.float32)[labels]
    self._rng = np.random.default_rng(seed)
    self._order = self._rng.permutation(len(images))
    self._at = 0

  def next_batch(self, batch_size):
    if self._at + batch_size > len(self._order):
      self._order = self._rng.permutation(len(self.images))
      self._at = 0
    rows = self._order[self._at:self._at + batch_size]
    self._at += batch_size
    return self.images[rows], self.labels[rows]


def read_data_sets(unused_data_dir, one_hot=False):
  if not one_hot:
    raise ValueError("this stand-in serves one-hot labels only, as "
                     "mnist_replica.py asks; got one_hot=%r" % one_hot)
  data = _digits.load()
  return Datasets(DataSet(data.x_train, data.y_train, seed=0),
                  DataSet(data.x_test, data.y_test, seed=1))

"""Stand-in for ``inception.imagenet_data``: the bundled digits as the data set."""

from examples import _digits


class ImagenetData:
  """The interface the trainer uses: sizes and class count, no files."""

  def __init__(self, subset):
    self.subset = subset
    self.data = _digits.load()

  def num_classes(self):
    return _digits.NUM_CLASSES

  def num_examples_per_epoch(self):
    return len(self.data.x_train)

  def data_files(self):
    # The original lists TFRecord shards; the digits are in memory.
    return ['sklearn.datasets.load_digits']

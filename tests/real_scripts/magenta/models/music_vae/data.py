"""Stand-in for ``magenta.models.music_vae.data``: the digits as sequences.

``get_dataset`` yields what the trainer's ``_get_input_tensors`` unpacks:
``(input_sequence, output_sequence, control_sequence, sequence_length)``
batches. Each 8x8 digit is a sequence of its 8 rows (depth 8), the output
"sequence" is its one-hot label (one step, depth 10), there is no control
(depth 0) and every length is 8. Replicas read the same data in their own
shuffled order, as MusicVAE's readers did.
"""

import numpy as np
import tensorflow.compat.v1 as tf

from examples import _digits


def get_dataset(config, tf_file_reader=None, is_training=False,
                cache_dataset=True):
  del tf_file_reader, cache_dataset
  data = _digits.load()
  x = data.x_train.reshape(-1, 8, 8)
  y = np.eye(_digits.NUM_CLASSES, dtype=np.float32)[data.y_train][:, None, :]
  control = np.zeros((len(x), 8, 0), np.float32)
  length = np.full((len(x),), 8, np.int32)
  dataset = tf.data.Dataset.from_tensor_slices((x, y, control, length))
  if is_training:
    dataset = dataset.repeat().shuffle(256, seed=1)
  return dataset.batch(config.hparams.batch_size, drop_remainder=True)


def count_examples(*unused_args):
  return len(_digits.load().x_test)

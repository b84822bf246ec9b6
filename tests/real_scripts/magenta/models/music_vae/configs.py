"""Stand-in for ``magenta.models.music_vae.configs``: one small config.

``CONFIG_MAP['digits']`` has what the trainer reads: a model with MusicVAE's
``build`` / ``train`` / ``loss`` / ``global_step`` interface (a small
classifier over the 8 rows of a digit, Adam with MusicVAE's default learning
rate schedule, an int64 global step from ``get_or_create_global_step``),
hyperparameters with MusicVAE's gradient-clipping defaults, and a data
converter's depths.
"""

import collections
import copy

import tensorflow.compat.v1 as tf

Config = collections.namedtuple(
    'Config', ['model', 'hparams', 'data_converter', 'train_examples_path',
               'eval_examples_path', 'tfds_name'])
DataConverter = collections.namedtuple(
    'DataConverter', ['input_depth', 'output_depth', 'control_depth'])


class HParams:
  """``values()`` and ``parse('a=1,b=2')``, as contrib's HParams had."""

  def __init__(self, **values):
    self.__dict__.update(values)

  def values(self):
    return dict(self.__dict__)

  def parse(self, text):
    for item in filter(None, text.split(',')):
      name, value = item.split('=')
      setattr(self, name, type(getattr(self, name))(value))
    return self


class DigitsRowModel:
  """MusicVAE's training interface around a small classifier."""

  def build(self, hparams, output_depth, is_training=True):
    del is_training
    self.hparams = hparams
    self._output_depth = output_depth
    self.global_step = tf.train.get_or_create_global_step()

  def train(self, input_sequence, output_sequence, sequence_length,
            control_sequence=None):
    del sequence_length, control_sequence
    hp = self.hparams
    flat = tf.reshape(input_sequence, [-1, 64])
    w1 = tf.get_variable('encoder/kernel', [64, 64],
                         initializer=tf.glorot_uniform_initializer(seed=1))
    b1 = tf.get_variable('encoder/bias', [64],
                         initializer=tf.zeros_initializer())
    w2 = tf.get_variable('decoder/kernel', [64, self._output_depth],
                         initializer=tf.glorot_uniform_initializer(seed=2))
    b2 = tf.get_variable('decoder/bias', [self._output_depth],
                         initializer=tf.zeros_initializer())
    logits = tf.matmul(tf.nn.relu(tf.matmul(flat, w1) + b1), w2) + b2
    self.loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
        labels=output_sequence[:, 0, :], logits=logits))
    # MusicVAE's schedule: decays from learning_rate to min_learning_rate.
    lr = ((hp.learning_rate - hp.min_learning_rate) *
          tf.pow(hp.decay_rate, tf.to_float(self.global_step)) +
          hp.min_learning_rate)
    return tf.train.AdamOptimizer(lr)


CONFIG_MAP = {
    'digits': Config(
        model=DigitsRowModel(),
        hparams=HParams(batch_size=64, learning_rate=0.01,
                        min_learning_rate=0.001, decay_rate=0.9999,
                        clip_mode='global_norm', grad_clip=1.0,
                        grad_norm_clip_to_zero=10000),
        data_converter=DataConverter(input_depth=8, output_depth=10,
                                     control_depth=0),
        train_examples_path='sklearn.datasets.load_digits',
        eval_examples_path=None, tfds_name=None),
}


def update_config(config, update_dict):
  config_dict = config._asdict()
  config_dict.update(update_dict)
  return Config(**{k: copy.copy(v) if k == 'hparams' else v
                   for k, v in config_dict.items()})

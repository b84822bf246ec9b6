"""Stand-in for ``inception.inception_model``: a small model, same interface.

``inference`` builds one batch-normalized hidden layer and a softmax layer
with ``slim.variables.variable`` (so the trainer's arg_scope puts them on the
ps); the batch norm's moving-statistics updates go to
``slim.ops.UPDATE_OPS_COLLECTION`` and its moving mean/variance to
MOVING_AVERAGE_VARIABLES, as Inception's batch norm did (the trainer asserts
the updates exist and averages those variables). ``loss`` adds the
cross-entropy to ``slim.losses.LOSSES_COLLECTION``.
"""

import tensorflow.compat.v1 as tf

from inception.slim import slim

MOVING_AVERAGE_DECAY = 0.9999
HIDDEN = 32


def inference(images, num_classes, for_training=False):
  del for_training  # The stand-in always normalizes by the batch statistics.
  glorot = tf.glorot_uniform_initializer
  w1 = slim.variables.variable('hidden/weights', [images.shape[1], HIDDEN],
                               initializer=glorot(seed=1))
  beta = slim.variables.variable('hidden/beta', [HIDDEN],
                                 initializer=tf.zeros_initializer())
  moving_mean = slim.variables.variable(
      'hidden/moving_mean', [HIDDEN], initializer=tf.zeros_initializer(),
      trainable=False, collections=[tf.GraphKeys.MOVING_AVERAGE_VARIABLES])
  moving_var = slim.variables.variable(
      'hidden/moving_variance', [HIDDEN], initializer=tf.ones_initializer(),
      trainable=False, collections=[tf.GraphKeys.MOVING_AVERAGE_VARIABLES])
  pre = tf.matmul(images, w1)
  mean, var = tf.nn.moments(pre, [0])
  for moving, value in ((moving_mean, mean), (moving_var, var)):
    tf.add_to_collection(slim.ops.UPDATE_OPS_COLLECTION,
                         tf.assign_sub(moving, 0.1 * (moving - value)))
  hidden = tf.nn.relu(tf.nn.batch_normalization(pre, mean, var, beta, None,
                                                1e-3))
  w2 = slim.variables.variable('logits/weights', [HIDDEN, num_classes],
                               initializer=glorot(seed=2))
  b2 = slim.variables.variable('logits/biases', [num_classes],
                               initializer=tf.zeros_initializer())
  return tf.matmul(hidden, w2) + b2


def loss(logits, labels, batch_size=None):
  del batch_size
  cross_entropy = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                     logits=logits),
      name='cross_entropy')
  tf.add_to_collection(slim.losses.LOSSES_COLLECTION, cross_entropy)

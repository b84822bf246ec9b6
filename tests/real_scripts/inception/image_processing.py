"""Stand-in for ``inception.image_processing``: its flags and distorted_inputs.

Like the original, the batches come from a queue fed by QueueRunners in the
QUEUE_RUNNERS collection (the trainer starts them with
``sv.start_queue_runners``), and labels are shifted by one: label 0 is
Inception's unused background class.
"""

import tensorflow.compat.v1 as tf

FLAGS = tf.app.flags.FLAGS

tf.app.flags.DEFINE_integer('batch_size', 32,
                            """Number of images to process in a batch.""")
tf.app.flags.DEFINE_integer('num_preprocess_threads', 4,
                            """Number of preprocessing threads per tower.""")


def distorted_inputs(dataset, batch_size=None, num_preprocess_threads=None):
  with tf.device('/cpu:0'):
    image, label = tf.train.slice_input_producer(
        [tf.constant(dataset.data.x_train),
         tf.constant(dataset.data.y_train.astype('int32') + 1)],
        shuffle=True, seed=1)
    images, labels = tf.train.shuffle_batch(
        [image, label], batch_size=batch_size or FLAGS.batch_size,
        num_threads=num_preprocess_threads or FLAGS.num_preprocess_threads,
        capacity=4 * (batch_size or FLAGS.batch_size),
        min_after_dequeue=batch_size or FLAGS.batch_size, seed=2)
  return images, tf.reshape(labels, [batch_size or FLAGS.batch_size])

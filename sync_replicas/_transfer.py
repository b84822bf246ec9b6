"""transfer_dtype: float32 tensors cross between tasks in 16 bits.

Owns the option ``transfer_dtype`` (its check and its environment variable)
and the casts it adds: a float32 tensor about to cross to another task is
encoded where it was made (a worker's gradient, a ps task's packed read) and
decoded to float32 where it arrives, before anything computes with it. The
accumulators, their sums and averages, the wrapped optimizer's update and the
variables (the master copies) stay float32 on the ps: only the bytes in
flight are 16-bit, as Horovod's ``Compression.fp16`` does for gradients and
Keras mixed precision for a model's weights.

What is rounded where (docs/options.md):

* bfloat16 (float32's range, 8 significant bits): a plain cast each way; a
  received value is exactly ``float32(bfloat16(x))``, rounded to nearest
  even.
* float16 (11 significant bits, largest finite 65504): a tensor whose largest
  magnitude is 32768 or more would overflow or come close; it is scaled by
  ``2**-k`` first (``k`` the smallest power that brings it under 32768) and
  ``k`` travels as one more float16 element at the end of the flat tensor;
  the receiver multiplies by ``2**k``. Powers of two scale exactly, so a
  received value is ``float32(float16(x * 2**-k)) * 2**k``, and ``k`` is 0
  for every tensor below 32768: then exactly ``float32(float16(x))``.
  Nothing overflows: a gradient of 1e6 arrives as 1e6 to float16's
  precision. Magnitudes under float16's smallest subnormal (6e-8, scaled by
  ``2**k``) arrive as 0, as with any float16 compression; bfloat16 has no
  such floor. A non-finite value stays non-finite.

Other dtypes (float64, integers, and tensors already 16-bit) cross as they
are. ``NoCompression`` (the default) builds nothing: the graph is the one
without the option.
"""

import os

import tensorflow as tf

# The TensorFlow logger's child, as the other options' lines.
_LOG = tf.get_logger().getChild(__name__)

#: Read by the optimizer's constructor when ``transfer_dtype`` is None, so
#: that a script run unchanged (``python -m sync_replicas.patch``) or an
#: Estimator's model_fn can turn it on.
ENV = "SYNC_REPLICAS_TRANSFER_DTYPE"

_BY_NAME = {"bfloat16": tf.bfloat16, "float16": tf.float16,
            "float32": tf.float32}

#: float16's scaling bound: a flat tensor's largest magnitude is brought
#: under 2**15, so that rounding it can never reach 65520 (infinity).
_F16_EXPONENT_LIMIT = 15


def dtype_from(transfer_dtype, environ=None):
  """``transfer_dtype`` as ``tf.bfloat16``, ``tf.float16`` or None (off).

  Accepts a ``tf.DType`` or its name; ``tf.float32`` means off whatever the
  environment says; None reads ``ENV`` (unset or empty: off).

  Raises:
    ValueError: anything else, naming what arrived.
  """
  if transfer_dtype is None:
    text = (os.environ if environ is None else environ).get(ENV, "")
    name = text.strip().lower()
    if not name:
      return None
    if name not in _BY_NAME:
      raise ValueError(
          "%s must be bfloat16, float16 or float32 (off), got %r. Set it to "
          "bfloat16 to send the float32 gradients and packed reads of a "
          "script run unchanged in 16 bits, or unset it." % (ENV, text))
    transfer_dtype = name
  dtype = transfer_dtype
  if isinstance(transfer_dtype, str):
    dtype = _BY_NAME.get(transfer_dtype.strip().lower())
  elif not isinstance(transfer_dtype, tf.DType):
    dtype = None
  if dtype not in (tf.bfloat16, tf.float16, tf.float32):
    raise ValueError(
        "transfer_dtype must be tf.bfloat16, tf.float16, tf.float32 (off) or "
        "None (the environment's %s), or one of their names, got %r. Pass "
        "tf.bfloat16 to send float32 gradients and packed reads in 16 bits."
        % (ENV, transfer_dtype))
  return None if dtype == tf.float32 else dtype


def _flat(tensor):
  return tensor if tensor.shape.rank == 1 else tf.reshape(tensor, [-1])


def _power_of_two(exponent):
  """``2.0 ** exponent`` for int32 exponents in [-126, 127], exactly (the
  float32 whose exponent field is that; ``tf.pow`` may approximate)."""
  return tf.bitcast(tf.bitwise.left_shift(exponent + 127, 23), tf.float32)


class NoCompression:
  """``transfer_dtype`` off: every tensor crosses as it is."""

  dtype = None

  def compresses(self, dtype):
    del dtype
    return False

  def encode(self, tensor):
    return tensor

  def decode(self, wire, like_dtype, shape):
    del like_dtype, shape
    return wire

  def send(self, grad):
    return grad

  def receive(self, wire, like, shape):
    del like, shape
    return wire

  def log(self):
    pass


#: The one ``NoCompression``: builds nothing, so one serves everywhere.
UNCOMPRESSED = NoCompression()


class Compression:
  """``transfer_dtype=tf.bfloat16`` or ``tf.float16``: float32 tensors cross
  in that dtype.

  ``encode`` runs where the tensor was made (call it in that device scope,
  or use ``send``, which colocates); ``decode`` runs in the caller's device
  scope, where the value is used.
  """

  def __init__(self, dtype, *, scope):
    self.dtype = dtype
    # Ours, not stock's: the casts go under the optimizer's own scope, so
    # that no stock op name changes.
    self._scope = scope + "transfer_dtype/"
    self._encoded = 0

  def compresses(self, dtype):
    """True for float32 (a variable's ref dtype too): what crosses in 16 bits."""
    return dtype.base_dtype == tf.float32

  def encode(self, tensor):
    """The wire form of a float32 ``tensor`` (others are returned as they are).

    bfloat16: the same shape; float16: flat, one exponent element longer.
    """
    if tensor.dtype != tf.float32:
      return tensor
    self._encoded += 1
    with tf.compat.v1.name_scope(self._scope), tf.compat.v1.name_scope(
        "encode"):
      if self.dtype == tf.bfloat16:
        return tf.cast(tensor, tf.bfloat16)
      flat = _flat(tensor)
      biggest = tf.reduce_max(tf.abs(flat))
      # The float's own exponent field, exact where a log2 would round:
      # biggest is in [2**e, 2**(e+1)); 0, subnormal or an empty tensor's
      # lowest value give e <= -127 and no scaling.
      e = tf.bitwise.right_shift(tf.bitcast(biggest, tf.int32), 23) - 127
      k = tf.maximum(e + 1 - _F16_EXPONENT_LIMIT, 0)
      scaled = flat * _power_of_two(-k)
      return tf.concat([tf.cast(scaled, tf.float16),
                        tf.cast(tf.reshape(k, [1]), tf.float16)], 0)

  def decode(self, wire, like_dtype, shape):
    """``wire`` back as a float32 tensor of ``shape``.

    Args:
      wire: What ``encode`` returned, received here.
      like_dtype: The dtype before ``encode``: nothing to undo unless
        float32.
      shape: The tensor's shape before ``encode``: a ``TensorShape`` (one
        unknown dimension at most) or a shape tensor.
    """
    if like_dtype != tf.float32:
      return wire
    with tf.compat.v1.name_scope(self._scope), tf.compat.v1.name_scope(
        "decode"):
      if self.dtype == tf.bfloat16:
        return tf.cast(wire, tf.float32)
      k = tf.cast(wire[-1], tf.int32)
      values = tf.cast(wire[:-1], tf.float32) * _power_of_two(k)
      if isinstance(shape, tf.TensorShape):
        if shape.rank == 1:
          return tf.ensure_shape(values, shape)
        shape = [-1 if d is None else d for d in shape.as_list()]
      return tf.reshape(values, shape)

  def send(self, grad):
    """A dense or sparse gradient's wire form, encoded beside it (its
    worker), whatever the caller's device scope."""
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    with tf.compat.v1.colocate_with(values):
      wire = self.encode(values)
    if isinstance(grad, tf.IndexedSlices):
      return tf.IndexedSlices(wire, grad.indices, grad.dense_shape)
    return wire

  def receive(self, wire, like, shape):
    """``send``'s result back as ``like`` was, in the caller's device scope.

    ``shape``: the dense gradient's static shape (a sparse one's values are
    reshaped to ``like``'s rows).
    """
    if not isinstance(like, tf.IndexedSlices):
      return self.decode(wire, like.dtype, self._shape(shape, like))
    values = self.decode(wire.values, like.dtype,
                         self._shape(like.values.shape, like.values))
    return tf.IndexedSlices(values, wire.indices, wire.dense_shape)

  def _shape(self, shape, tensor):
    """What float16's decode reshapes to: ``shape`` if no more than its
    first dimension is unknown, else ``tensor``'s dynamic shape, read beside
    it (a small int32 transfer; never ``tensor`` itself). bfloat16 keeps
    the shape through its cast and needs none."""
    if self.dtype != tf.float16 or (shape.rank is not None and all(
        d is not None for d in shape[1:])):
      return shape
    with tf.compat.v1.colocate_with(tensor), tf.compat.v1.name_scope(
        self._scope):
      return tf.shape(tensor, name="shape")

  def log(self):
    _LOG.info("transfer_dtype: %d float32 tensors per step now cross as %s",
              self._encoded, self.dtype.name)


def codec(dtype, *, scope):
  """The unit for ``options.transfer_dtype``; ``scope`` is the optimizer's
  own name scope (``<name>_status/``)."""
  return UNCOMPRESSED if dtype is None else Compression(dtype, scope=scope)

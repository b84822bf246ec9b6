"""Packed gradient transfers: one tensor per ps task, per-variable accumulators.

Stock pushes each dense gradient from the worker straight into its
variable's accumulator on the ps, so every variable costs one cross-task
transfer per step (measured here: 200 separate 100-float tensors take about
16 ms to reach a ps, the same floats as one tensor under 3 ms). With
``pack_gradient_transfers`` the worker concatenates its small dense gradients
bound for one ps task, one tensor crosses, and the ps splits it back and
pushes every part into the variable's own stock accumulator
(``<var>/grad_accum``). The accumulators, their names and devices, their
staleness checks and what the chief takes from them are exactly stock's:
only the route of the gradient bytes changes.

Large gradients keep their own transfer: their cost is bandwidth, which
packing cannot cut, and a concatenation would copy them once more and make
them wait for the slowest of the group.

``group_by``, ``flat`` and ``split_to_shapes`` (group per ps task, concatenate,
split) are shared with the fused accumulators (``_fused``); ``move_packed``
(all three, across devices) with packed reads (``reads``).
"""

import collections
import contextlib

import tensorflow as tf

from sync_replicas import _compat
from sync_replicas import _transfer

#: Gradients with more elements than this travel on their own. Per-tensor
#: overhead here is about 80 us, which is what ~128 KiB cost on loopback, so
#: above that packing saves little and its extra copy starts to cost.
MAX_PACKED_ELEMENTS = 1 << 15


def small(tensor_or_variable):
  """Fully shaped and at most MAX_PACKED_ELEMENTS elements: worth packing."""
  shape = tensor_or_variable.shape
  return (shape.is_fully_defined()
          and shape.num_elements() <= MAX_PACKED_ELEMENTS)


def group_by(items, key):
  """Indices of ``items`` grouped by ``key(item)``, in first-seen order.

  Items whose key is None are left out. Returns a list of
  ``(key, [index, ...])``.
  """
  groups = collections.OrderedDict()
  for i, item in enumerate(items):
    k = key(item)
    if k is not None:
      groups.setdefault(k, []).append(i)
  return list(groups.items())


def _pack_key(pair):
  grad, var = pair
  # A variable without a device gives no task to pack for (local runs).
  if (grad is not None and var.device and _compat.is_dense_gradient(grad)
      and small(grad)):
    return var.device, grad.dtype
  return None


def flat(tensor):
  """``tensor`` as a vector; a vector already is one (no Reshape op)."""
  return tensor if tensor.shape.rank == 1 else tf.reshape(tensor, [-1])


def split_to_shapes(packed, shapes, *, name):
  """Splits a concatenation of ``flat`` tensors back into ``shapes``.

  A part already of its shape (any vector) is used as it is: with 200
  variables, 200 reshapes would be 200 more ops on the ps.
  """
  parts = tf.split(packed, [s.num_elements() for s in shapes], name=name)
  return [part if part.shape == shape else tf.reshape(part, shape)
          for part, shape in zip(parts, shapes, strict=True)]


def move_packed(items, key, tensor_of, *, packed_on_group_device,
                concat_name, split_name, arrive=lambda packed: packed,
                wire=_transfer.UNCOMPRESSED):
  """Moves each group of tensors between two devices as one tensor.

  Groups ``items`` by ``key`` (a ``(device, dtype)`` pair, or None to leave
  an item alone). For every group of two or more, builds ``tensor_of(item)``
  for each member, concatenates them (``flat``) and splits the
  concatenation back into their shapes. With ``packed_on_group_device`` the
  tensors are built and concatenated on the group's device and split in the
  caller's device scope (reads from a ps task); otherwise the reverse
  (pushes to a ps task). ``arrive`` is applied to each concatenation
  where it is split, before the split. ``wire`` (the ``_transfer`` unit)
  encodes each concatenation where it is made and decodes it, before
  ``arrive``, where it is split.

  Returns:
    A list parallel to ``items``: each packed member's part, None for the
    others. One tensor has nothing to share, so groups of one are left
    alone too.
  """
  routed = [None] * len(items)
  for (device, _), members in group_by(items, key):
    if len(members) < 2:
      continue
    there = tf.compat.v1.device(device)
    here = contextlib.nullcontext()
    packing, unpacking = ((there, here) if packed_on_group_device
                          else (here, there))
    with packing:
      tensors = [tensor_of(items[i]) for i in members]
      packed = tf.concat([flat(t) for t in tensors], axis=0, name=concat_name)
      sent = wire.encode(packed)
    with unpacking:
      received = wire.decode(sent, packed.dtype, packed.shape)
      parts = split_to_shapes(arrive(received), [t.shape for t in tensors],
                              name=split_name)
    for i, part in zip(members, parts, strict=True):
      routed[i] = part
  return routed


def pack(grads_and_vars, *, scope, arrive=lambda packed: packed,
         wire=_transfer.UNCOMPRESSED):
  """Routes small dense gradients to each ps task as one tensor.

  Call in the worker's device scope (the concatenation runs there); the
  split runs on each variable's device.

  Args:
    grads_and_vars: (gradient, variable) pairs; None and sparse gradients,
      and gradients of unknown or large shape, are left alone.
    scope: The name scope (ours, not stock's) for the ops this adds.
    arrive: Applied on the ps to each concatenation before its split (the
      statistics' ordering after their pre-push read).
    wire: The ``_transfer`` unit each concatenation crosses in.

  Returns:
    A list parallel to ``grads_and_vars``: for a packed gradient, its values
    on its variable's device; None for one left alone. Only groups of two
    or more (one device, one dtype) are packed.
  """
  grads_and_vars = list(grads_and_vars)
  with tf.compat.v1.name_scope(scope):
    return move_packed(grads_and_vars, _pack_key, lambda pair: pair[0],
                       packed_on_group_device=False,
                       concat_name="packed_gradients",
                       split_name="unpacked_gradients", arrive=arrive,
                       wire=wire)

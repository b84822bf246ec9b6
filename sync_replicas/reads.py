"""Packed variable reads: one transfer per ps task for a model's small variables.

A model reads each variable it uses from the variable's ps task once a step:
one tensor crosses per variable, whichever optimizer trains it. Traced here
(1 ps, 1 worker, 200 variables of 100 floats), those 200 transfers take about
10 ms of a 16 ms step once the gradients travel fused: after the pushes, the
reads are the per-variable cost left. ``read_packed`` reads the small
variables of each ps task on that task, concatenates them there, one tensor
crosses, and the caller's device (the worker) splits it back.

Nothing else changes: every returned tensor has its variable's value, shape
and dtype, and the gradient of a loss with respect to a variable is what it
would be through the variable's own read (concatenation and split pass
gradients through unchanged), so ``compute_gradients`` and any optimizer,
stock's included, see the same numbers. It is a model-side helper, opt-in:
the model must read its variables through it (Keras layers, which read their
own weights, cannot).
"""

import typing

import tensorflow as tf

from sync_replicas import _packing


def _check(variables):
  if isinstance(variables, (tf.Variable, tf.Tensor)) or not isinstance(
      variables, (list, tuple)):
    raise TypeError(
        "read_packed expects a list or tuple of tf.Variable, got %r. Pass "
        "the variables as a list, e.g. read_packed([w, b])." % (variables,))
  if tf.executing_eagerly():
    raise RuntimeError(
        "read_packed builds graph ops, but eager execution is on. Call it "
        "while building a tf.compat.v1 graph (tf.compat.v1."
        "disable_eager_execution(), or inside `with tf.Graph().as_default()`)"
        ", where between-graph training runs.")
  graph = tf.compat.v1.get_default_graph()
  for i, var in enumerate(variables):
    if not isinstance(var, tf.Variable):
      raise TypeError(
          "read_packed expects a list of tf.Variable, got %r at index %d. "
          "Pass variables (not their values or partitioned variables; read "
          "the parts of a PartitionedVariable with list(var))." % (var, i))
    if var.graph is not graph:
      raise ValueError(
          "read_packed: variable %r at index %d belongs to another graph "
          "than the default one. Call it inside `with graph.as_default():` "
          "of the graph that holds the variables." % (var.op.name, i))


def _key(var):
  # A variable without a device has no task to read from (a local run).
  if var.device and _packing.small(var):
    return var.device, var.dtype.base_dtype
  return None


def read_packed(variables: "typing.Sequence[tf.Variable]",
                name: str = "packed_reads") -> "list[tf.Tensor]":
  """Reads ``variables``, one transfer per (ps task, dtype) for small ones.

  Variables of one device and dtype with at most
  ``MAX_PACKED_ELEMENTS`` (32768) elements each and fully defined shapes
  are read together when there are two or more of them; the others are
  read as a model would read them (``tf.convert_to_tensor``). Call it in
  the device scope of the ops that consume the values (the worker's, e.g.
  under ``replica_device_setter``): the split runs there.

  Args:
    variables: A list or tuple of ``tf.Variable`` (resource or ref) of the
      default graph.
    name: The name scope of the ops added.

  Returns:
    A list of tensors parallel to ``variables``, each its variable's current
    value, differentiable with respect to the variable.

  Raises:
    TypeError: ``variables`` is not a list or tuple of variables.
    ValueError: a variable belongs to another graph.
    RuntimeError: eager execution is on.
  """
  _check(variables)
  with tf.compat.v1.name_scope(name):
    # read_value, not the cached value: a caching_device would move the read
    # off the ps before the concatenation.
    values = _packing.move_packed(
        variables, _key, lambda var: var.read_value(),
        packed_on_group_device=True, concat_name="packed_values",
        split_name="unpacked_values")
  return [value if value is not None else tf.convert_to_tensor(var)
          for var, value in zip(variables, values, strict=True)]

"""Gradient routes: how each worker's gradients reach an accumulator.

Owns the worker-side half of ``apply_gradients``: which gradients share a
fused accumulator (``fuse_dense_gradients``), the preparation of the others
on the worker (combining sparse duplicates), how they cross to the ps (packed
with ``pack_gradient_transfers``, or each on its own as stock), the
statistics' ordering where they arrive (on the ps, so that no worker op
waits for the ps before a push), and the per-variable accumulators with
their pushes and takes. Each choice is a strategy with one method; ``build``
runs them in stock's build order, which fixes every op name.
"""

import collections

import tensorflow as tf

from sync_replicas import _accumulators
from sync_replicas import _compat
from sync_replicas import _data_end
from sync_replicas import _fused
from sync_replicas import _packing
from sync_replicas import _transfer

# pushes: every push op, the train op's dependencies; aggregated: the
# (averaged gradient, variable) pairs for the wrapped optimizer, in the
# caller's order (None gradients passed through, as in stock); accumulators:
# every _accumulators.AccumulatorOps, in build order.
Routes = collections.namedtuple("Routes",
                                ["pushes", "aggregated", "accumulators"])


class NoFusion:
  """Stock's route: every variable keeps its own accumulator."""

  def route(self, grads_and_vars, *, arrive, gate, name, local_step,
            num_required, wire):
    del grads_and_vars, arrive, gate, name, local_step, num_required, wire
    return {}, Routes([], [], [])


class FusedAccumulators:
  """``fuse_dense_gradients``: one accumulator per ps task and dtype."""

  def route(self, grads_and_vars, *, arrive, gate, name, local_step,
            num_required, wire):
    """Builds the fused accumulators.

    Returns:
      ``(averaged, routes)``: the averaged gradient of every fused variable
      by ``id(var)``, and the fused pushes and accumulators.
    """
    fusable = [(g, v) for g, v in grads_and_vars
               if g is not None and _fused.fusable(g, v)]
    averaged, pushes, entries = {}, [], []
    for group in _fused.group_by_task(fusable):
      entry, grads = _fused.build(group, name=name, local_step=local_step,
                                  replicas_to_aggregate=num_required,
                                  arrive=arrive, gate=gate, wire=wire)
      pushes.append(entry.push)
      entries.append(entry)
      for (_, var), grad in zip(group.pairs, grads, strict=True):
        averaged[id(var)] = grad
    return averaged, Routes(pushes, [], entries)


class DirectTransfers:
  """Stock's transfers: each gradient crosses to its ps on its own."""

  def route(self, prepared, variables, *, scope, arrive, wire):
    del variables, scope, arrive, wire
    return [None] * len(prepared)


class PackedTransfers:
  """``pack_gradient_transfers``: small dense gradients cross as one tensor."""

  def route(self, prepared, variables, *, scope, arrive, wire):
    """Returns each packed gradient's part on its ps, None for the others.

    ``arrive`` is applied on the ps to each packed tensor, before its split;
    ``wire`` (``_transfer``) encodes it on the worker and decodes it there.
    """
    return _packing.pack(zip(prepared, variables, strict=True),
                         scope=scope + "packed_transfers/", arrive=arrive,
                         wire=wire)


def fusion(options):
  return FusedAccumulators() if options.fuse_dense_gradients else NoFusion()


def transfers(options):
  return (PackedTransfers() if options.pack_gradient_transfers
          else DirectTransfers())


def _prepare(grads_and_vars, fused, *, combine_sparse_duplicates):
  """What each variable's own accumulator is pushed, prepared on the worker.

  None: fused, or passed through to the wrapped optimizer, as in stock.
  """
  prepared = []
  for grad, var in grads_and_vars:
    if id(var) in fused or grad is None:
      prepared.append(None)
      continue
    if combine_sparse_duplicates and _compat.is_sparse_gradient(grad):
      # On the worker, so only the combined rows cross to the ps.
      grad = _accumulators.combine_duplicates(grad)
    prepared.append(grad)
  return prepared


#: Ops whose OutOfRangeError ends a worker's input (a dataset's iterator, an
#: input queue, a reader, a Python function such as a generator's).
_INPUT_OPS = frozenset({
    "IteratorGetNext", "IteratorGetNextSync",
    "MultiDeviceIteratorGetNextFromShard",
    "QueueDequeue", "QueueDequeueV2", "QueueDequeueMany",
    "QueueDequeueManyV2", "QueueDequeueUpTo", "QueueDequeueUpToV2",
    "ReaderRead", "ReaderReadV2", "ReaderReadUpTo", "ReaderReadUpToV2",
    "PyFunc", "PyFuncStateless", "EagerPyFunc",
})

#: Ops that run a part of the graph conditionally, in a loop or in a
#: function: a control edge from inside them is not one from a plain op (a
#: branch not taken would never release the push), and a function hides
#: its input ops from the walk.
_CONTROL_FLOW_OPS = frozenset({
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter",
    "Exit", "RefExit", "NextIteration", "RefNextIteration", "LoopCond",
    "If", "StatelessIf", "While", "StatelessWhile", "Case",
    "StatelessCase", "PartitionedCall", "StatefulPartitionedCall",
})


def _input_ops(tensors):
  """The input ops the ``tensors`` depend on, or None where the walk meets
  control flow or a function call (it cannot tell then)."""
  found, seen = [], set()
  stack = [t.op for t in tensors]
  while stack:
    op = stack.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.type in _CONTROL_FLOW_OPS:
      return None
    if op.type in _INPUT_OPS:
      found.append(op)
      continue  # Beyond it: its iterator, queue or reader handle.
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return sorted(found, key=lambda op: op.name)


def _push_gate(grads_and_vars, *, options, scope):
  """The control inputs of every push (none with ``data_end="stock"``):
  the input ops of the run, so that a run whose input ended pushes nothing.

  Without a gate a gradient that does not depend on the input (a
  regularizer's, a bias with no data path) was still pushed by the run whose
  input ended, into its own accumulator alone; the chief's loop, which counts
  one accumulator, could then release an update whose take completed on that
  variable and waited forever on another (the hang at 16 workers and 2 ps:
  docs/data_end.md). Gating on the input ops (a dataset's ``get_next``, an
  input queue's dequeue: what raises when the input ends) costs nothing: they
  run first in a step, and every push still starts as soon as its gradient
  is ready. A run with no input op (fed placeholders, constants) cannot end
  on its data: no gate. Where the walk cannot tell (control flow, a
  function call on the way) the gate is every gradient computed, which
  holds each push until the backward pass ends. One group on the worker, in
  our scope, and one control edge per push: no stock op gains or loses an
  input.
  """
  if options.data_end == _data_end.STOCK:
    return []
  tensors = _compat.gradient_tensors(grads_and_vars)
  if not tensors:
    return []
  inputs = _input_ops(tensors)
  if inputs == []:
    return []
  with tf.compat.v1.name_scope(scope):
    if inputs is None:
      return [tf.group(*tensors, name="gradients_computed")]
    return [tf.group(*inputs, name="input_read")]


def build(grads_and_vars, *, options, stats, name, prefix, scope,
          local_step, num_required, wire):
  """Routes every gradient to an accumulator; returns the ``Routes``.

  Call in the worker's device scope, under the optimizer's name scope.
  ``wire`` (``_transfer``) is how float32 gradients cross, on every route.
  """
  gate = _push_gate(grads_and_vars, options=options, scope=scope)
  arrive = stats.order_gradient
  fused, routes = fusion(options).route(
      grads_and_vars, arrive=arrive, gate=gate, name=name,
      local_step=local_step, num_required=num_required, wire=wire)
  prepared = _prepare(grads_and_vars, fused,
                      combine_sparse_duplicates=(
                          options.combine_sparse_duplicates))
  variables = [var for _, var in grads_and_vars]
  routed = transfers(options).route(prepared, variables, scope=scope,
                                    arrive=arrive, wire=wire)
  for var, grad, on_ps in zip(variables, prepared, routed, strict=True):
    if id(var) in fused:
      routes.aggregated.append((fused[id(var)], var))
      continue
    with tf.compat.v1.device(var.device):
      if grad is None:
        routes.aggregated.append((None, var))  # Passed through, as in stock.
        continue
      # A packed part was ordered before its split, once for its group,
      # and crossed in its wire form with it; the others are ordered on
      # their ps, as their push receives them, and cross on their own.
      entry = _accumulators.build(
          on_ps if on_ps is not None else grad, var, local_step=local_step,
          replicas_to_aggregate=num_required, prefix=prefix,
          sparse_reduction=options.sparse_reduction,
          arrive=(arrive if on_ps is None else lambda part: part),
          wire=wire if on_ps is None else _transfer.UNCOMPRESSED,
          gate=gate)
    routes.pushes.append(entry.push)
    routes.aggregated.append((entry.take, var))
    routes.accumulators.append(entry)
  return routes

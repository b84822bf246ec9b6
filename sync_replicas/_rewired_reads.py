"""pack_variable_reads: a model built by anyone reads its ps variables packed.

Owns the graph rewrite behind ``pack_variable_reads=True``: the reads of the
trained variables that ops of another task consume (the worker's forward
pass and the gradient ops built from it) are rerouted to parts of one packed
read per (ps task, dtype), built as ``read_packed`` builds it: the task reads
its variables, concatenates them, one tensor crosses and the consumers' device
splits it back. It needs no edit to the model, so it works whoever built it
(plain ``tf.compat.v1`` code, Keras 2 layers, tf-slim, an Estimator's
model_fn).

When: at the start of ``apply_gradients``, once the forward pass and the
gradients exist and before any op of ours. Rewiring after the gradients, not
before them (in ``compute_gradients``), keeps the gradient graph exactly the
one the wrapped optimizer built: only the inputs that carried a variable's
value change, to a tensor holding the same bits, so every number is a plain
read's; it also covers gradients a script computed itself (``tf.gradients``
then ``apply_gradients``). Ops built later read as they always do: the chief's
update, the averages and the savers run on the variables' own task, where
nothing crosses.

What is left a plain read, and counted in the log line: variables too large
to pack (``_packing.MAX_PACKED_ELEMENTS``; their cost is bandwidth), of a
non-float dtype, without a device (a local run) or alone on their (ps task,
dtype), except that with ``transfer_dtype`` a float32 variable too large or
alone gets a 16-bit read of its own (``_transfer``: the cast halves the
bandwidth); reads made under control dependencies (packing would order the whole
group after them); reads and consumers inside control flow or a function
(a ``cond``'s or ``while_loop``'s own reads, which the rewrite cannot reach);
and gathers, which read rows, not the variable. A read moves whole (every
cross-task consumer) or stays whole: its consumers saw one value, and two
reads could straddle an update the chief applies. Control dependencies on a
read are kept: the original read op stays in the graph, only its data edges
to the other task move. Ordering against the token is what plain reads
have: a step's reads are part of its own run, which starts after the
previous run's token was taken; nothing in the graph ties either to it.
"""

import collections
import typing

import tensorflow as tf

from sync_replicas import _checks
from sync_replicas import _compat
from sync_replicas import _packing
from sync_replicas import _prefetch
from sync_replicas import _transfer

# The TensorFlow logger's child, as the statistics' lines: a script that
# sets TensorFlow's verbosity to INFO sees the summary line.
_LOG = tf.get_logger().getChild(__name__)

#: Read by the optimizer's constructor when ``pack_variable_reads`` is None,
#: so that a script run unchanged (``python -m sync_replicas.patch``) can
#: turn it on.
ENV = "SYNC_REPLICAS_PACK_VARIABLE_READS"

#: Ops that take a value into control flow or a function: what they consume
#: is read there, out of the rewrite's reach.
_CONTROL_FLOW = frozenset([
    "Enter", "RefEnter", "Switch", "RefSwitch", "If", "StatelessIf", "While",
    "StatelessWhile", "Case", "StatelessCase", "PartitionedCall",
    "StatefulPartitionedCall"])
_GATHERS = frozenset(["ResourceGather", "ResourceGatherNd", "Gather",
                      "GatherV2", "GatherNd"])

# Why a read was left plain: the log line's words.
HUGE = "of variables over %d elements" % _packing.MAX_PACKED_ELEMENTS
NOT_FLOAT = "of non-float variables"
NO_DEVICE = "of variables without a device"
ALONE = "of variables alone on their ps task and dtype"
CONTROL_DEPENDENCIES = "under control dependencies"
CONTROL_FLOW = "inside control flow or a function"
GATHER = "by gathers"


def enabled_from(pack_variable_reads, environ=None):
  """``pack_variable_reads`` as a bool; None reads ``ENV`` (unset: False).

  Raises:
    ValueError: as ``_checks.flag_from``.
  """
  return _checks.flag_from("pack_variable_reads", ENV, pack_variable_reads, environ)


class Report(typing.NamedTuple):
  """What one rewrite did.

  Attributes:
    rewired: ``(read op name, variable name, consumer op names)`` for every
      read whose cross-task consumers now take a packed read's part.
    packed_reads: Packed reads built: the transfers each step now makes for
      the rewired variables.
    left_plain: Reads (one per consumer edge) left as they were, by reason.
    prefetched: Of ``packed_reads``, those read after the token into a
      worker-local copy (``prefetch_variable_reads``).
    fresh: Reads kept fresh with ``prefetch_variable_reads``: an op
      outside the gradients consumes them (``_prefetch``).
  """
  rewired: typing.Tuple[typing.Tuple[str, str, typing.Tuple[str, ...]], ...]
  packed_reads: int
  left_plain: typing.Dict[str, int]
  prefetched: int = 0
  fresh: int = 0


def _task(device):
  spec = tf.DeviceSpec.from_string(device or "")
  return spec.job, spec.replica, spec.task


def _source(var):
  """The tensor every read of ``var`` takes: its handle, or its ref."""
  return var.op.outputs[0] if _compat.is_ref_variable(var) else var.handle


def _is_read(op, var):
  return op.type == ("Identity" if _compat.is_ref_variable(var)
                     else "ReadVariableOp")


def _edges(tensor, here):
  """``(consumer, input index)`` of ``tensor`` on another task than ``here``."""
  return [(op, i) for op in tensor.consumers()
          for i, t in enumerate(op.inputs)
          if t is tensor and _task(op.device) != here]


class _Found:
  """The cross-task reads of the trained variables, sorted into packable
  ``(read, [(consumer, index), ...])`` per variable and counted others.

  With ``wire`` compressing a dtype (``transfer_dtype``), a variable of it
  too large to pack is still rerouted, to a 16-bit read of its own: its
  cost is bandwidth, which is what the cast halves.
  """

  def __init__(self, wire, inside=None):
    # var -> [(read, edges, prefetched)]
    self.packable = collections.OrderedDict()
    self.left_plain = collections.Counter()
    self.fresh = 0  # Reads kept fresh with prefetch: consumed outside.
    self._wire = wire
    # With prefetch_variable_reads, the ops the gradients need: a read one
    # of whose consumers is among them comes from the copy (_prefetch).
    self._inside = inside

  def _prefetched(self, edges):
    if self._inside is None:
      return False
    # A read this train op runs: its forward ops (when the gradients need
    # them) or its gradient ops. Its other consumers (the loss of
    # ``w * w``, which the gradients do not need, a summary sharing the
    # read) then see the copy, the value the step started with.
    if any(consumer in self._inside for consumer, _ in edges):
      return True
    self.fresh += 1
    return False

  def variable(self, var):
    here = _task(var.device)
    source = _source(var)
    reads = []
    for op in source.consumers():
      if _is_read(op, var):
        # A read moves whole or not at all: its consumers saw one value, and
        # two reads of it could straddle an update the chief applies.
        edges = _edges(op.outputs[0], here)
        if any(consumer.type in _CONTROL_FLOW for consumer, _ in edges):
          self.left_plain[CONTROL_FLOW] += len(edges)
        elif edges and op.control_inputs:
          self.left_plain[CONTROL_DEPENDENCIES] += len(edges)
        elif edges:
          reads.append((op, edges, self._prefetched(edges)))
      elif _task(op.device) != here and op.type in _CONTROL_FLOW:
        self.left_plain[CONTROL_FLOW] += 1
      elif _task(op.device) != here and op.type in _GATHERS:
        self.left_plain[GATHER] += 1
    for read in reads:
      reason = self._unpackable(var, prefetched=read[2])
      if reason:
        self.left_plain[reason] += len(read[1])
      else:
        self.packable.setdefault(var, []).append(read)

  def _unpackable(self, var, *, prefetched):
    if not var.device:
      return NO_DEVICE
    if not var.dtype.base_dtype.is_floating:
      return NOT_FLOAT
    # A large variable's copy still saves its trip (prefetched), and its
    # 16-bit read half its bytes.
    if (not _packing.small(var) and not prefetched
        and not self._wire.compresses(var.dtype)):
      return HUGE
    return None


def _groups(packable):
  """Variables by (consumer task, variable device, dtype), in graph order.

  Each read joins the group of its consumers' task, all its edges with it
  (one value for all of them, as before). A consumer without a device
  (gradients computed outside the worker's device scope) runs on the task
  its session connects to: when one task is all the others name, its read
  joins that task's group instead of costing a transfer of its own.

  Returns:
    ``{(task, variable device, dtype, None or a large variable's name,
    prefetched): [split device, {var: [(read, consumer, index), ...]}]}``.
  """
  named = {_task(consumer.device)
           for reads in packable.values() for _, edges, _ in reads
           for consumer, _ in edges if consumer.device}
  default = next(iter(named)) if len(named) == 1 else _task("")
  groups = collections.OrderedDict()
  for var, reads in packable.items():
    for read, edges, prefetched in reads:
      devices = [c.device for c, _ in edges if c.device] or [""]
      task = _task(devices[0]) if devices[0] else default
      # A large variable (only packable with transfer_dtype) is read on its
      # own: a concatenation would copy it once more.
      key = (task, var.device, var.dtype.base_dtype,
             None if _packing.small(var) else var.op.name, prefetched)
      group = groups.setdefault(key, [devices[0], collections.OrderedDict()])
      if not group[0]:
        group[0] = devices[0]
      group[1].setdefault(var, []).extend(
          (read, consumer, index) for consumer, index in edges)
  return groups


def _packed_parts(consumer_device, variables, wire):
  """One packed read of ``variables`` (one task, one dtype), split back on
  ``consumer_device``; a float32 one crosses in ``wire``'s dtype
  (``_transfer``), cast back there: the master copies stay float32."""
  # Cleared: the caller's device function and control dependencies (an
  # apply_gradients under `control_dependencies(update_ops)`, the usual
  # batch-norm recipe) would move the reads or order them after ops that
  # consume them.
  with tf.compat.v1.device(None), tf.control_dependencies(None):
    with tf.compat.v1.device(variables[0].device):
      # read_value, not the cached value: a caching_device would move the
      # read off the ps before the concatenation.
      values = [var.read_value() for var in variables]
      packed = tf.concat([_packing.flat(v) for v in values], axis=0,
                         name="packed_values")
      sent = wire.encode(packed)
    with tf.compat.v1.device(consumer_device or None):
      return _packing.split_to_shapes(
          wire.decode(sent, packed.dtype, packed.shape),
          [v.shape for v in values], name="unpacked_values")


def rewire(grads_and_vars, *, scope, wire=_transfer.UNCOMPRESSED,
           prefetched=None):
  """Reroutes the cross-task reads of the variables trained to packed reads.

  Args:
    grads_and_vars: The pairs ``apply_gradients`` got; variables with a
      gradient are the ones whose reads may move.
    scope: Our name scope (the ops added go under ``<scope>packed_reads``).
    wire: The ``_transfer`` unit the packed reads cross in.
    prefetched: A ``_prefetch.Prefetched`` (``prefetch_variable_reads``):
      reads only the gradients consume come from its worker-local copies,
      one per group, alone or large ones included; None: fresh reads.

  Returns:
    A ``Report``.
  """
  inside = (None if prefetched is None
            else _prefetch.gradient_ancestors(grads_and_vars))
  found = _Found(wire, inside)
  seen = set()
  for grad, var in grads_and_vars:
    if grad is not None and var.op.name not in seen:
      seen.add(var.op.name)
      found.variable(var)
  rewired = collections.defaultdict(list)
  packed_reads = 0
  with tf.compat.v1.name_scope(scope), tf.compat.v1.name_scope(
      "packed_reads"):
    for key, (consumer_device, by_var) in _groups(found.packable).items():
      if key[-1]:
        # Its trip is saved whatever its size: the copy is read here.
        parts = prefetched.parts(consumer_device, list(by_var))
        packed_reads += 1
      # One variable gains from a packed read only by its cast.
      elif len(by_var) < 2 and not wire.compresses(
          next(iter(by_var)).dtype):
        found.left_plain[ALONE] += sum(len(e) for e in by_var.values())
        continue
      else:
        parts = _packed_parts(consumer_device, list(by_var), wire)
        packed_reads += 1
      for (var, edges), part in zip(by_var.items(), parts, strict=True):
        for read, consumer, index in edges:
          _compat.update_input(consumer, index, part)
          rewired[(read.name, var.op.name)].append(consumer.name)
  report = Report(
      rewired=tuple((read, var, tuple(consumers))
                    for (read, var), consumers in rewired.items()),
      packed_reads=packed_reads,
      left_plain={k: v for k, v in found.left_plain.items() if v},
      prefetched=0 if prefetched is None else prefetched.count,
      fresh=found.fresh)
  _log(report)
  return report


def _log(report):
  for read, var, consumers in report.rewired:
    _LOG.debug("pack_variable_reads: rewired read %s of %s (consumers %s)",
               read, var, ", ".join(consumers))
  plain = "; ".join("%d %s" % (n, why)
                    for why, n in sorted(report.left_plain.items()))
  _LOG.info("pack_variable_reads: %d reads of %d variables now cross as %d "
            "packed reads; reads left plain: %s", len(report.rewired),
            len({var for _, var, _ in report.rewired}), report.packed_reads,
            plain or "none")
  if report.prefetched or report.fresh:
    _LOG.info("prefetch_variable_reads: %d packed reads made after the "
              "token into worker-local copies; %d reads kept fresh (%s)",
              report.prefetched, report.fresh, _prefetch.OUTSIDE)


class PackedVariableReads:
  """``pack_variable_reads=True``: ``rewire`` at the start of the build."""

  def build(self, grads_and_vars, *, scope, wire, prefetched=None):
    return rewire(grads_and_vars, scope=scope, wire=wire,
                  prefetched=prefetched)


class NoPackedVariableReads:
  """``pack_variable_reads=False``: the graph is left as it is."""

  def build(self, grads_and_vars, *, scope, wire, prefetched=None):
    del grads_and_vars, scope, wire, prefetched
    return None


def policy(enabled):
  """The unit for ``options.pack_variable_reads``."""
  return PackedVariableReads() if enabled else NoPackedVariableReads()

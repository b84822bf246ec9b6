"""prefetch_variable_reads: the next step's variables come with the token.

With ``pack_variable_reads`` a worker's step still makes three dependent
trips to the ps: its forward pass waits for the packed reads, its pushes
follow the gradients, and its train op then waits for a token. The token
is released only after the chief's update, so the variables read right
after it are the ones the next step reads. Here each packed read is made
on the ps once the token is dequeued (a control edge from the dequeue)
and kept in a worker-local copy (a local resource variable, one per packed
read, in our name scope); the next step's forward pass and gradient ops
read that copy, on the worker. The values and the token cross together at
the end of a run, and the next run starts with its variables in hand: two
dependent trips a step instead of three.

Why the numbers and the staleness rule are the plain read's: a gradient
pushed with local step ``t`` (its token's step) survives only if the
accumulators' global step is still ``t`` when it lands. The copy is read
after the token of step ``t`` was dequeued, and the chief releases that
token only after update ``t`` (and the global step's increment) is done,
so the copy holds step ``t`` or newer; a surviving gradient was therefore
computed from exactly step ``t``'s variables, as a plain read's is (which
also happens after the token and before the push). Where the schedule is
deterministic, each step reads the same bits either way
(tests/test_prefetch.py, against stock's optimizer).

Where the copy is not used, and a fresh read is made instead:

* The first step and every new session (a restarted worker, or a session
  recreated after a ps restart): the local init (``local_step_init_op``,
  and ``chief_init_op``, which holds it) reads every copy fresh, after it
  set the local step from the global step, so the copy is never older than
  the local step. There is no copy from an earlier session to trust.
* Reads that no op of this optimizer's gradient computation consumes (a
  summary's own read of a weight, another model's reads): they stay fresh
  packed reads, as ``pack_variable_reads`` builds them. The copy is
  refreshed only by this train op, so an op run without it reads a value
  that no token of its own vouches for. A read the gradients share with
  other ops (the loss fetched beside the train op, a summary) gives those
  ops the copy: in the train op's run the value the step started with;
  in a run without it (an evaluation), the variables as of the worker's
  last token. Two sync optimizers whose train ops share a read (a GAN's
  discriminator read by the generator's loss, the same read op) are not
  told apart: the second's run reads the first's copy.

Nothing else differs between modes (backups, multi-batch accumulation,
deadlines, ``data_end``, one token queue per worker): each is a rule about
which tokens and gradients count, and the copy is as fresh as the plain read
made after the same token, or fresher.
"""

import tensorflow as tf

from sync_replicas import _checks
from sync_replicas import _compat
from sync_replicas import _packing

#: Read by the optimizer's constructor when ``prefetch_variable_reads`` is
#: None, so that a script run unchanged can turn it on.
ENV = "SYNC_REPLICAS_PREFETCH_VARIABLE_READS"
#: Why a read stays fresh: the log line's words.
OUTSIDE = "of variables consumed outside the gradients"


class _Copy:
  """One packed read's worker-local copy and what reads it."""

  def __init__(self, consumer_device, variables, copy, value):
    self.consumer_device = consumer_device
    self.variables = variables
    self.copy = copy
    self.value = value


class Prefetched:
  """The copies of one optimizer's packed reads, refreshed after its token.

  ``parts`` replaces a packed read (``_rewired_reads``); ``refresh`` and
  ``prime`` build the two ops that fill the copies: after the token, in the
  train op, and after the local step's init, in the local init.
  """

  def __init__(self, *, wire, scope):
    self._wire = wire
    self._scope = scope
    self._copies = []

  @property
  def count(self):
    """Copies built: the packed reads now made after the token."""
    return len(self._copies)

  def parts(self, consumer_device, variables):
    """The parts of a copy of ``variables`` (one ps task, one dtype), read
    on ``consumer_device``; the copy is filled by ``refresh``/``prime``."""
    sizes = sum(v.shape.num_elements() for v in variables)
    dtype = variables[0].dtype.base_dtype
    with tf.compat.v1.device(None), tf.control_dependencies(None):
      with tf.compat.v1.device(consumer_device or None):
        # A local variable: the worker's own, never saved, initialized by
        # the local init (zeros, overwritten at once by ``prime``).
        copy = tf.compat.v1.Variable(
            tf.zeros([sizes], dtype), trainable=False, use_resource=True,
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
            name="prefetched_values")
        value = copy.read_value()
        parts = _packing.split_to_shapes(
            value, [v.shape for v in variables], name="unpacked_values")
    self._copies.append(_Copy(consumer_device, variables, copy, value))
    return parts

  def _fill(self, after, name):
    assigns = []
    with tf.compat.v1.name_scope(self._scope), \
        tf.compat.v1.name_scope(name):
      for c in self._copies:
        with tf.compat.v1.device(None), tf.control_dependencies(None):
          with tf.compat.v1.device(c.variables[0].device), \
              tf.control_dependencies(after):
            # read_value on the variable's task, as a packed read makes it.
            packed = tf.concat(
                [_packing.flat(v.read_value()) for v in c.variables], axis=0,
                name="packed_values")
            sent = self._wire.encode(packed)
          # The step's own read of the copy goes first: its consumers must
          # see the value the step started with, not this one.
          with tf.compat.v1.device(c.consumer_device or None), \
              tf.control_dependencies([c.value.op]):
            assign = c.copy.assign(
                self._wire.decode(sent, packed.dtype, packed.shape),
                read_value=False)
            assigns.append(getattr(assign, "op", assign))
    return assigns

  def refresh(self, after):
    """The copies' assigns from reads made after ``after`` (the token)."""
    return self._fill(after, "prefetch")

  def prime(self, after):
    """The copies' assigns from reads made after ``after`` (the local
    step's init): the fresh read of a new session."""
    return self._fill(after, "prefetch_init")


class NoPrefetch:
  """``prefetch_variable_reads=False``: nothing to fill."""

  count = 0

  def refresh(self, after):
    del after
    return []

  def prime(self, after):
    del after
    return []


def gradient_ancestors(grads_and_vars):
  """Every op the gradients need (data and control inputs): a read one of
  them consumes runs in this optimizer's train op."""
  stack = [t.op for t in _compat.gradient_tensors(grads_and_vars)]
  seen = set()
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return seen


def enabled_from(prefetch_variable_reads, environ=None):
  """``prefetch_variable_reads`` as a bool; None reads ``ENV`` (unset:
  False).

  Raises:
    ValueError: as ``_checks.flag_from``.
  """
  return _checks.flag_from("prefetch_variable_reads", ENV,
                           prefetch_variable_reads, environ)


def check_with_packing(prefetch_variable_reads, pack_variable_reads):
  """Raises if prefetching is asked for with packed reads turned off: the
  copies are packed reads' (it implies them otherwise)."""
  if enabled_from(prefetch_variable_reads) and pack_variable_reads is False:
    raise ValueError(
        "prefetch_variable_reads=True reads the variables as packed reads "
        "made after the token, but pack_variable_reads=False was passed. "
        "Leave pack_variable_reads at None or True (prefetching turns it "
        "on), or turn prefetch_variable_reads off.")


def policy(enabled, *, wire, scope):
  """The unit for ``options.prefetch_variable_reads``."""
  return Prefetched(wire=wire, scope=scope) if enabled else NoPrefetch()

"""Sync statistics: what the protocol did, as summaries and log lines.

Owns, when the optimizer is built with ``statistics=True``, the counters and
timings of the protocol, their scalar summaries and their log line:

* per worker (worker-local resource variables, in ``LOCAL_VARIABLES`` so
  every replica's local init zeroes them): gradients pushed, gradients
  dropped as stale, tokens taken, seconds blocked waiting for a token, the
  largest staleness of a dropped gradient;
* for the whole cluster (resource variables on the global step's device,
  in no collection: never checkpointed, never part of a readiness check,
  initialized once by the chief's init op and kept across chief restarts):
  the same counts summed over every worker, and updates applied by the
  chief's sync op.

Every op lives in the optimizer's ``<name>_status`` name scope, so no stock op
name changes; with ``statistics=False`` nothing here is built.

Stale drops are counted exactly as the accumulator decides them, with one
documented exception: a push is counted as dropped when the global step
(generation-encoded), read after the worker's step began and before its
push, is already past the worker's local step. Every accumulator's own step
is at least the global step (the chief takes before it increments), so each
counted drop is a real one. The only drop not counted is a push that reaches
the accumulator inside the chief's take-then-increment window for that same
step (between its ``take_grad`` and the global step's increment,
microseconds of graph execution): the count is a lower bound that is exact
whenever no push races the chief's apply, as in every scripted scenario.

Where the counting runs, and why: inside the round trips the protocol
already makes. The global step is read, and compared with the local step a
push carried, on the global step's ps; each push waits for that read where
it arrives, on its own ps (``order_gradient``), so no worker op waits for a
ps result before a push. The token's wait is timed on the ps
around the dequeue, and the cluster counters are added there from ps
values. The token and the worker's counts come back to the worker as one
tensor, which the train op's assign reads the token from: statistics add
no transfer, and nothing of ours runs between the pushes and the dequeue on
the worker. A run that fails before its token
(a closed queue at shutdown) therefore counts nothing, on the worker as on
the cluster.
"""

import collections
import contextlib

import tensorflow as tf

from sync_replicas import _compat
from sync_replicas import _restart

# The TensorFlow logger's child: the lines obey tf.get_logger()'s level and
# handlers, like TensorFlow's own "loss = ..." lines.
_LOG = tf.get_logger().getChild(__name__)

#: Worker-side counters, in summary and log order.
WORKER_COUNTERS = ("gradients_pushed", "gradients_dropped_stale",
                   "tokens_taken", "token_wait_secs", "token_wait_secs_last",
                   "staleness_max")
#: Cluster-wide counters, summed over every worker on the ps.
CLUSTER_COUNTERS = ("gradients_pushed", "gradients_dropped_stale",
                    "tokens_taken", "token_wait_secs", "staleness_sum")
#: Scalars derived on the chief from the cluster counters and status ops.
CHIEF_SCALARS = ("updates_applied", "gradients_per_update", "staleness_mean",
                 "gradients_pending", "tokens_queued")

_FLOAT = ("token_wait_secs", "token_wait_secs_last")

# What a worker's push left for its token's bookkeeping, passed from
# ``after_pushes`` to ``after_token``, every tensor on the global step's ps.
# ops: what the dequeue must follow (ps-local); stale_count: 1 if the push
# was certainly stale; staleness: by how many steps; at: when the pushes
# had landed.
Pushed = collections.namedtuple("Pushed",
                                ["ops", "stale_count", "staleness", "at"])


def _variable(name, dtype, collections_):
  return tf.compat.v1.Variable(
      tf.zeros([], dtype), trainable=False, collections=collections_,
      use_resource=True, name=name)


class Statistics:
  """The graph side of the statistics, built by ``apply_gradients``.

  Call order (it follows the train op's data flow): ``__init__`` before the
  accumulators, ``order_gradient`` on what each push receives, on its ps,
  before the push is built, ``after_pushes`` before the token dequeue,
  ``after_token`` (given what ``after_pushes`` returned) before the train
  op's assign,
  ``count_update`` on the chief's sync op, and ``finish`` last.
  ``NoStatistics`` has the same methods and builds nothing.
  """

  def __init__(self, *, scope, tag_prefix, global_step, local_step,
               local_anchor, generations, colocate, deadline_updates=False):
    """Creates the variables and the pre-push reads.

    Args:
      scope: The optimizer's own name scope (``<name>_status/``).
      tag_prefix: First component of every summary tag (the optimizer name).
      global_step: The global step variable.
      local_step: The worker's ``sync_rep_local_step``.
      local_anchor: An op on this worker's device.
      generations: The ``_restart.Generations``.
      colocate: ``_compat.colocate_with_local_anchor``.
      deadline_updates: Also count the updates the aggregation deadline
        released (``min_replicas_to_aggregate``).
    """
    self._scope = scope
    self._tag_prefix = tag_prefix
    self._global_step = global_step
    self._local_step = local_step
    self._generations = generations
    self._ps_device = global_step.device
    self._worker_device = local_anchor.device
    self.tensors = {}
    with tf.compat.v1.name_scope(scope):
      with colocate(local_anchor), tf.compat.v1.name_scope("worker"):
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        self._worker = {
            k: _variable(k, tf.float64 if k in _FLOAT else tf.int64, local)
            for k in WORKER_COUNTERS}
      with tf.compat.v1.device(self._ps_device), \
          tf.compat.v1.name_scope("cluster"):
        self._cluster = {
            k: _variable(k, tf.float64 if k in _FLOAT else tf.int64, [])
            for k in CLUSTER_COUNTERS + ("updates_applied",) + (
                ("deadline_updates",) if deadline_updates else ())}
      with tf.compat.v1.device(self._ps_device), \
          tf.compat.v1.name_scope("pre_push"):
        # Read on the ps, where the comparison runs: the worker never waits
        # for it. Every push of this step follows this read
        # (order_gradient), which is what makes "already past" a certain
        # drop.
        raw = tf.convert_to_tensor(global_step)
        self._global_before = tf.cast(raw, tf.int64, name="global_step")
        self._global_encoded = tf.cast(generations.encode(raw), tf.int64,
                                       name="global_step_encoded")

  def _pushed_local_step(self, pushes):
    """The local step this step's push carried, as an int64 on the ps.

    A push on the global step's ps already brings it there (every
    accumulator push takes ``local_step`` as its second input): using that
    tensor adds no transfer, as TensorFlow sends a tensor once per device,
    and compares exactly the value the accumulator judged. Without such a
    push, a read of our own crosses beside the gradients; it is the same
    value, as the local step changes only in the train op's last assign,
    which follows the counts. Nothing on the worker waits for either.
    """
    for push in pushes:
      carried = push.inputs[1] if len(push.inputs) > 1 else None
      if (carried is not None and carried.dtype == tf.int64
          and _same_task(push.device, self._ps_device)):
        return carried
    with self._under_scope(self._worker_device), \
        tf.compat.v1.name_scope("pre_push"):
      return tf.cast(self._local_step.read_value(), tf.int64,
                     name="local_step")

  def _under_scope(self, device):
    return _in_scope(self._scope, device)

  def order_gradient(self, grad):
    """``grad`` made to wait for the pre-push read (same kind and values).

    Call in the push's device scope (its ps), on what the push receives
    there: the wait is then on the ps, for a read on the global step's ps,
    and the worker sends its gradient without waiting for anything.
    """
    # The encoded step is computed from the read, so waiting for it waits
    # for both: one control edge, which crosses tasks for a push on another
    # ps than the global step's (a transfer of its own each).
    deps = [self._global_encoded]
    sparse = _compat.is_sparse_gradient(grad)
    with self._under_scope(None), tf.control_dependencies(deps):
      if sparse:
        return tf.IndexedSlices(tf.identity(grad.values, name="ordered_grad"),
                                grad.indices, grad.dense_shape)
      return tf.identity(grad, name="ordered_grad")

  def after_pushes(self, pushes):
    """Decides this step's push's staleness and times its end, on the ps.

    Returns:
      A ``Pushed``: ``ops`` the token dequeue must follow (a timestamp on
      the dequeue's own device), and what ``after_token`` needs.
    """
    local_before = self._pushed_local_step(pushes)
    with self._under_scope(self._ps_device):
      stale = self._global_encoded > local_before
      stale_count = tf.cast(stale, tf.int64)
      # The local step carries the restart generation above 2**32; compare
      # plain steps for how far behind the gradient was.
      plain_local = local_before
      if self._generations.enabled:
        plain_local = tf.math.floormod(plain_local,
                                       _restart.GENERATION_STRIDE)
      staleness = tf.where(
          stale, tf.maximum(self._global_before - plain_local, 1),
          tf.zeros([], tf.int64))
      # On the dequeue's device, so the dequeue's wait for it is local: the
      # token's wait starts once every push landed, as the ps saw it.
      with tf.control_dependencies(pushes):
        pushed_at = tf.timestamp(name="pushed_at")
    return Pushed([pushed_at], stale_count, staleness, pushed_at)

  def after_token(self, token, pushed):
    """Counts the push, the token and the wait; hands the worker its token.

    The token and the worker's counts cross to the worker as one tensor, so
    statistics add no transfer to the step: the train op's assign reads the
    token out of it (the one rewiring of a stock op's input that statistics
    make, checked by test_graph_parity). The tensor is made after the
    cluster counts, so the assign follows those too without a cross-task
    control edge (which would be a transfer of its own).

    Args:
      token: The token dequeued.
      pushed: What ``after_pushes`` returned.

    Returns:
      ``(token, ops)``: the token for the train op's assign (on the worker,
      same dtype and value as ``token``) and the ops that assign follows.
    """
    with self._under_scope(self._ps_device):
      with tf.control_dependencies([token]):
        wait = tf.timestamp(name="token_at") - pushed.at
      c = self._cluster
      # The cluster counts move only once a token arrived: tokens exist
      # only after the chief's init op initialized these counters, and a
      # non-chief may push before that.
      cluster = tf.group(
          c["gradients_pushed"].assign_add(1),
          c["gradients_dropped_stale"].assign_add(pushed.stale_count),
          c["staleness_sum"].assign_add(pushed.staleness),
          c["tokens_taken"].assign_add(1),
          c["token_wait_secs"].assign_add(wait),
          name="count_cluster")
      with tf.control_dependencies([cluster]):
        # int64 throughout: the token may carry a generation above 2**53,
        # and the wait's float64 bits travel unchanged.
        carried = tf.stack([tf.cast(token, tf.int64), pushed.stale_count,
                            pushed.staleness,
                            tf.bitcast(wait, tf.int64)],
                           name="token_and_counts")
    with self._under_scope(self._worker_device):
      step, stale_count, staleness, wait_bits = tf.unstack(carried)
      wait = tf.bitcast(wait_bits, tf.float64)
      if token.dtype != tf.int64:
        step = tf.cast(step, token.dtype)
      w = self._worker
      return step, [tf.group(
          w["gradients_pushed"].assign_add(1),
          w["gradients_dropped_stale"].assign_add(stale_count),
          w["staleness_max"].assign(tf.maximum(w["staleness_max"],
                                               staleness)),
          w["tokens_taken"].assign_add(1),
          w["token_wait_secs"].assign_add(wait),
          w["token_wait_secs_last"].assign(wait),
          name="count_token")]

  def count_update(self, sync_op, by_deadline=None):
    """The chief's sync op, followed by counting the update it applied.

    Args:
      sync_op: The chief's sync op.
      by_deadline: With a deadline, a function building (in the caller's
        name scope) a bool tensor: the deadline released this update (its
        takes needed fewer than replicas_to_aggregate). They average every
        fresh gradient present when they run, so a gradient that arrived
        after the chief's decision still counts: ``gradients_per_update``
        has the exact average.
    """
    if by_deadline is not None:
      by_deadline = by_deadline()
    with self._under_scope(self._ps_device):
      counts = []
      with tf.control_dependencies([sync_op]):
        counts.append(self._cluster["updates_applied"].assign_add(1))
        if by_deadline is not None:
          counts.append(self._cluster["deadline_updates"].assign_add(
              tf.cast(by_deadline, tf.int64)))
        return tf.group(*counts, name="count_update")

  def worker_init_ops(self):
    """Zeroes this worker's counters (also in ``LOCAL_VARIABLES``)."""
    with self._under_scope(None):
      return [tf.group(*[v.initializer for v in self._worker.values()],
                       name="init_worker_counters")]

  def init_ops(self):
    """Initializes the cluster counters unless they exist (chief restarts).

    Part of ``chief_init_op`` and of the init-tokens op: a script may run
    either alone. Idempotent, so running both is harmless. Returns a list of
    one op.
    """
    return [self._init_op()]

  def _init_op(self):
    ops = []
    with self._under_scope(self._ps_device), tf.compat.v1.name_scope("init"):
      for var in self._cluster.values():
        ops.append(tf.cond(
            tf.compat.v1.is_variable_initialized(var),
            lambda v=var: tf.identity(v.read_value()),
            lambda v=var: v.assign(tf.zeros([], v.dtype)).read_value()))
      return tf.group(*ops, name="init_cluster_counters")

  def finish(self, status, *, workers_done=None, workers_gone=None):
    """Builds the summaries and the tensors the hook logs.

    Args:
      status: The ``_status.StatusOps`` (pending gradients, queued tokens).
      workers_done: With a ``data_end`` policy, the count of workers whose
        input ended (``chief/workers_done``); None: no such scalar.
      workers_gone: With ``worker_gone_secs``, the count of workers declared
        gone (``chief/workers_gone``); None: no such scalar.
    """
    with self._under_scope(self._ps_device):
      c = self._cluster
      pending = (tf.reduce_min(tf.stack(status.num_accumulated))
                 if status.num_accumulated else tf.constant(0))
      pending = tf.cast(pending, tf.int64)
      updates = c["updates_applied"].read_value()
      dropped = c["gradients_dropped_stale"].read_value()
      aggregated = c["gradients_pushed"].read_value() - dropped - pending
      chief = {
          "updates_applied": updates,
          "gradients_per_update": tf.math.divide_no_nan(
              tf.cast(aggregated, tf.float64), tf.cast(updates, tf.float64)),
          "staleness_mean": tf.math.divide_no_nan(
              tf.cast(c["staleness_sum"].read_value(), tf.float64),
              tf.cast(dropped, tf.float64)),
          "gradients_pending": pending,
          "tokens_queued": tf.cast(status.tokens, tf.int64),
      }
      if "deadline_updates" in c:
        chief["deadline_updates"] = c["deadline_updates"].read_value()
      if workers_done is not None:
        chief["workers_done"] = tf.cast(workers_done, tf.int64)
      if workers_gone is not None:
        chief["workers_gone"] = tf.cast(workers_gone, tf.int64)
    tensors = {}
    with self._under_scope(self._worker_device):
      for k in WORKER_COUNTERS:
        tensors["worker/" + k] = self._worker[k].read_value()
    with self._under_scope(self._ps_device):
      for k in CLUSTER_COUNTERS:
        tensors["cluster/" + k] = c[k].read_value()
    optional = tuple(k for k in ("deadline_updates", "workers_done",
                                 "workers_gone")
                     if k in chief)
    for k in CHIEF_SCALARS + optional:
      tensors["chief/" + k] = chief[k]
    with self._under_scope(None), tf.compat.v1.name_scope("summaries"):
      for key, value in tensors.items():
        # The op tf.compat.v1.summary.scalar builds, with the tag spelled out:
        # summary.scalar would prefix the tag with our name scope.
        summary = tf.raw_ops.ScalarSummary(
            tags="%s/%s" % (self._tag_prefix, key), values=value,
            name=key.replace("/", "_"))
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SUMMARIES,
                                       summary)
    self.tensors = tensors


class NoStatistics:
  """``statistics=False``: the methods of ``Statistics``, building nothing."""

  tensors: "dict[str, tf.Tensor]" = {}

  def order_gradient(self, grad):
    return grad

  def after_pushes(self, pushes):
    del pushes
    return Pushed([], None, None, None)

  def after_token(self, token, pushed):
    del pushed
    return token, []

  def count_update(self, sync_op, by_deadline=None):
    del by_deadline
    return sync_op

  def worker_init_ops(self):
    return []

  def init_ops(self):
    return []

  def finish(self, status, *, workers_done=None, workers_gone=None):
    del status, workers_done, workers_gone


def build(enabled, **kwargs):
  """``Statistics(**kwargs)`` if ``enabled``, else a ``NoStatistics``."""
  return Statistics(**kwargs) if enabled else NoStatistics()


def _same_task(a, b):
  """Whether device strings ``a`` and ``b`` name the same task."""
  a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
  return ((a.job, a.replica or 0, a.task or 0)
          == (b.job, b.replica or 0, b.task or 0))


@contextlib.contextmanager
def _in_scope(scope, device):
  """Our (absolute) name scope and, unless None, a device."""
  with tf.compat.v1.name_scope(scope):
    if device is None:
      yield
    else:
      with tf.compat.v1.device(device):
        yield


def format_line(values, *, is_chief):
  """One log line from the statistics' values (``Statistics.tensors``).

  Args:
    values: Fetched values keyed like ``Statistics.tensors``.
    is_chief: Adds the cluster and chief figures (which only the chief's
      summaries write).

  Returns:
    The line, without the leading "sync_replicas stats:".
  """
  line = ("worker: pushed=%d dropped_stale=%d tokens=%d token_wait=%.3fs "
          "(last %.3fs) max_staleness=%d" % tuple(
              values["worker/" + k] for k in WORKER_COUNTERS))
  if is_chief:
    line += ("; cluster: pushed=%d dropped_stale=%d tokens=%d "
             "token_wait=%.3fs; chief: updates=%d gradients/update=%.2f "
             "mean_staleness=%.2f pending=%d tokens_queued=%d" % (
                 tuple(values["cluster/" + k] for k in CLUSTER_COUNTERS[:4])
                 + tuple(values["chief/" + k] for k in CHIEF_SCALARS)))
    if "chief/deadline_updates" in values:
      line += " deadline_updates=%d" % values["chief/deadline_updates"]
    if "chief/workers_done" in values:
      line += " workers_done=%d" % values["chief/workers_done"]
    if "chief/workers_gone" in values:
      line += " workers_gone=%d" % values["chief/workers_gone"]
  return line


class StatsLogger:
  """Reads and logs the statistics every ``every_steps`` train steps.

  Used by the hook, after a train run (the hook's one rule,
  ``optimizer.runs_train_op``: a script's own reads between steps, such as
  the global step's, are not steps): the statistics are read in a run of
  their own on the same session, never added to the training run's fetches.
  A run with fetches of its own is a new signature for the session, which
  partitions, optimizes and registers its graph on every task the first
  time, and a training run with the statistics added is the whole model's
  graph again: on a step of a few milliseconds that set-up alone cost 4-9%
  of the steps in a 3-second bench window (docs/operations.md). A run of
  the statistics alone sets up a few dozen reads, and then costs one small
  run every ``every_steps``. ``every_steps`` of None or 0 never logs
  (summaries still work).
  """

  def __init__(self, tensors, *, every_steps, is_chief):
    # A non-chief's line shows only its own counters: worker-local reads,
    # so its log run waits for no ps.
    self._tensors = tensors if is_chief else {
        k: v for k, v in tensors.items() if k.startswith("worker/")}
    self._every = every_steps or 0
    self._is_chief = is_chief
    self._steps = 0

  def prepare(self, session):
    """Runs the log's read once, at session start (after the local init).

    The first run of a signature sets it up on every task it touches: done
    here, that is not a stall in the middle of training, where every other
    worker would wait for this one's gradient.
    """
    session.run(self._tensors)

  def after_train_step(self, session):
    """Counts a train run of ``session``; reads and logs the values when
    due."""
    self._steps += 1
    if not self._every or self._steps % self._every:
      return
    self.log(session.run(self._tensors))

  def log(self, values):
    _LOG.info("sync_replicas stats: %s",
              format_line(values, is_chief=self._is_chief))

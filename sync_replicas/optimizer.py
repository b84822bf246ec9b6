"""SyncReplicasOptimizer: synchronous data-parallel training on parameter servers.

Owns argument validation, the order in which ``apply_gradients`` builds the
graph (which fixes every op name, so it follows stock step by step), and the
delegation of everything else to the wrapped optimizer. The accumulators live
in ``_accumulators``, the token queue in ``_tokens`` and the session hook in
``hook``.

The protocol (stock's, unchanged):

* Every worker computes gradients and pushes them into one accumulator per
  variable; an accumulator drops any gradient whose worker-local step
  (``sync_rep_local_step``) is older than the global step it was last set to.
* The chief's queue runner takes ``replicas_to_aggregate`` gradients from each
  accumulator (their mean), applies them with the wrapped optimizer, which
  increments the global step, then enqueues ``max(total_num_replicas,
  replicas_to_aggregate)`` tokens carrying the new global step.
* A worker's train op waits for one token after its push and stores it as its
  local step: that is the barrier.
"""

import logging
import numbers

import tensorflow as tf

from sync_replicas import _accumulators
from sync_replicas import _checks
from sync_replicas import _compat
from sync_replicas import _fused
from sync_replicas import _packing
from sync_replicas import _keras
from sync_replicas import _manifest
from sync_replicas import _restart
from sync_replicas import _runner
from sync_replicas import _stats
from sync_replicas import _status
from sync_replicas import _tokens
from sync_replicas import _wrapped
from sync_replicas import errors
from sync_replicas import hook as hook_lib

_LOG = logging.getLogger(__name__)


class SyncReplicasOptimizer(_wrapped.WrappedOptimizer):
  """Class to synchronize, aggregate gradients and pass them to the optimizer.

  A drop-in for ``tf.compat.v1.train.SyncReplicasOptimizer``: same
  constructor, methods, attributes, graph names and numbers. Gradients from
  replicas are averaged, not summed, so scale the learning rate as for a
  larger batch.

  Usage::

    opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    opt = sync_replicas.SyncReplicasOptimizer(
        opt, replicas_to_aggregate=50, total_num_replicas=52)  # 2 backups
    train_op = opt.minimize(loss, global_step=global_step)
    hook = opt.make_session_run_hook(is_chief)
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=is_chief, hooks=[hook]) as sess:
      while not sess.should_stop():
        sess.run(train_op)

  Attributes (set by ``apply_gradients``; before it they raise
  ``errors.NotBuiltError``, an ``AttributeError``, as stock's are absent):
    chief_init_op: The chief's local init: its local step plus every
      accumulator's global step.
    local_step_init_op: A non-chief's local init: its local step.
    ready_for_local_init_op: Lists uninitialized global variables; empty once
      the chief has initialized the model.
  """

  def __init__(self,
               opt,
               replicas_to_aggregate,
               total_num_replicas=None,
               variable_averages=None,
               variables_to_average=None,
               use_locking=False,
               name="sync_replicas",
               *,
               prompt_stop=True,
               stall_log_secs=60.0,
               stall_timeout_secs=None,
               statistics: bool = False,
               statistics_log_steps: "int | None" = 100,
               fuse_dense_gradients: bool = False,
               pack_gradient_transfers: bool = True,
               averages_before_tokens: bool = False,
               combine_sparse_duplicates: bool = False,
               sparse_reduction: str = "row_mean",
               one_gradient_per_worker: bool = False,
               worker_index: "int | None" = None,
               min_replicas_to_aggregate: "int | None" = None,
               aggregation_deadline_secs: "float | None" = None):
    """Construct a sync_replicas optimizer.

    Args:
      opt: The actual optimizer that will be used to compute and apply the
        gradients. A ``tf.compat.v1.train.Optimizer``, or (not in stock) a
        Keras 2 legacy optimizer such as ``tf_keras.optimizers.legacy.Adam``.
      replicas_to_aggregate: Number of replicas to aggregate for each
        variable update.
      total_num_replicas: Total number of tasks/workers/replicas, could be
        different from replicas_to_aggregate. If greater, the difference is
        backup replicas; if smaller, replicas compute several batches per
        update. Defaults to ``replicas_to_aggregate``.
      variable_averages: Optional ``ExponentialMovingAverage`` applied by the
        chief after each update to ``variables_to_average``.
      variables_to_average: The variables to average; required with, and only
        with, ``variable_averages``.
      use_locking: Passed to the base Optimizer (unused, as in stock).
      name: The name scope of the accumulator ops.
      prompt_stop: Not in stock. True (default): the chief's queue runner
        ends as soon as its coordinator stops, so ``close()`` returns at once
        instead of after ``stop_grace_period_secs``. False: stock's
        QueueRunner behaviour, unchanged.
      stall_log_secs: Not in stock. While no update lands, the chief logs
        what the update waits for every this many seconds; 0 or None: never.
      stall_timeout_secs: Not in stock. If set, no update for this long stops
        the chief's coordinator with ``SyncStallError`` instead of waiting
        forever; None (default): wait, as stock does.
      statistics: Not in stock. True: count and time the protocol (gradients
        pushed and dropped as stale, tokens taken, seconds waiting for a
        token, updates applied) in the ``<name>_status`` name scope, as
        scalar summaries tagged ``<name>/worker/...``, ``<name>/cluster/...``
        and ``<name>/chief/...`` that MonitoredTrainingSession's summary
        saver writes, and as log lines from the hook. False (default): none
        of it is built; the graph is stock's.
      statistics_log_steps: Not in stock. With ``statistics``, the hook logs
        a ``sync_replicas stats:`` line (INFO, TensorFlow's logger) every
        this many session runs; 0 or None: never.
      fuse_dense_gradients: Not in stock. True: the dense gradients bound for
        one ps task (and of one dtype) travel as one concatenated tensor into
        one accumulator on that task and are split back there, instead of
        one accumulator and one transfer per variable. Same numbers and
        staleness rules; each update then averages one consistent set of
        gradients for all of a task's dense variables. Sparse gradients
        keep their own accumulators. False (default): stock's graph.
      pack_gradient_transfers: Not in stock. True: each worker sends its
        small dense gradients (up to 32768 elements each) bound for one ps
        task as one concatenated tensor, split back on the ps into every
        variable's own stock accumulator: one transfer per ps task instead
        of one per variable. Accumulators, names, staleness rules and
        numbers are stock's; only extra ops in the ``<name>_status`` scope
        route the bytes. True (default): measured 1.1x (small) to 1.3x (200
        variables) stock's steps/s. False: stock's graph exactly.
      averages_before_tokens: Not in stock. True: the chief applies
        ``variable_averages`` before it releases the tokens, so a worker that
        got its token reads averages that include the update. False
        (default): stock's order, tokens first, averages after.
      combine_sparse_duplicates: Not in stock. True: each worker sorts its
        sparse gradients' indices and sums the rows of repeated indices
        before pushing, as the sparse accumulator assumes; stock pushes
        ``tf.gather``/embedding gradients as they come, and the accumulator
        then neither merges nor averages their rows. False (default): as
        stock.
      sparse_reduction: Not in stock. How an update reduces sparse
        (``IndexedSlices``) gradients: ``"row_mean"`` (default, stock's):
        each row is the mean over the gradients that contain that row;
        ``"replica_mean"``: each row is the sum over all aggregated gradients
        divided by how many were aggregated, as a dense gradient would be
        averaged; ``"sum"``: each row is the plain sum. The last two imply
        ``combine_sparse_duplicates``. See the README for an example.
      one_gradient_per_worker: Not in stock. True: every worker waits on a
        token queue of its own that gets one token per update, and skips
        tokens no newer than the step it pushed at, so an update averages
        gradients of distinct workers; stock lets a fast worker take a slow
        one's token and fill two slots of one update. Needs
        ``worker_index``, ``total_num_replicas >= replicas_to_aggregate``
        ``prompt_stop=True`` and an int64 global step; the initial tokens
        are one per worker. False (default): stock's single
        ``sync_token_q``.
      worker_index: Not in stock. This worker's index in
        ``[0, total_num_replicas)`` (its task index), required with and only
        with ``one_gradient_per_worker``.
      min_replicas_to_aggregate: Not in stock. With
        ``aggregation_deadline_secs``: once that many seconds passed since
        the last update and every accumulator holds at least this many fresh
        gradients, the chief applies what arrived instead of waiting for
        ``replicas_to_aggregate``. Each such update is logged with the count
        present and, with ``statistics``, counted
        (``chief/deadline_updates``). Its takes average every fresh gradient
        present when they run, which may be more than the count logged. None (default):
        always wait for ``replicas_to_aggregate``, as stock does.
      aggregation_deadline_secs: Not in stock. The deadline for the above;
        set both or neither. Needs ``prompt_stop=True``.

    Raises:
      ValueError: For a non-positive or non-int replica count, or a
        ``variable_averages``/``variables_to_average`` mismatch.
      TypeError: If ``opt`` is neither a ``tf.compat.v1.train.Optimizer`` nor
        a Keras 2 legacy optimizer.
    """
    replicas_to_aggregate = _checks.positive_int(
        "replicas_to_aggregate", replicas_to_aggregate,
        "Pass how many gradients each update averages, e.g. the number of "
        "workers.")
    if total_num_replicas is None:
      total_num_replicas = replicas_to_aggregate
    total_num_replicas = _checks.positive_int(
        "total_num_replicas", total_num_replicas,
        "Pass the number of worker tasks, or None to use "
        "replicas_to_aggregate (%d)." % replicas_to_aggregate)
    # A Keras 2 legacy optimizer gets the v1 interface the protocol calls.
    opt = _keras.adapt(opt)
    _checks.v1_optimizer(opt)
    for knob, value in (("stall_log_secs", stall_log_secs),
                        ("stall_timeout_secs", stall_timeout_secs)):
      if value is not None and (isinstance(value, bool) or not isinstance(
          value, numbers.Real) or value < 0):
        raise ValueError(
            "%s must be a number of seconds >= 0 or None, got %r." %
            (knob, value))
    if statistics_log_steps is not None and (
        isinstance(statistics_log_steps, bool)
        or not isinstance(statistics_log_steps, numbers.Integral)
        or statistics_log_steps < 0):
      raise ValueError(
          "statistics_log_steps must be an int >= 0 or None, got %r. Pass how "
          "many session runs apart the hook logs statistics, or 0 for never."
          % (statistics_log_steps,))
    if worker_index is not None or one_gradient_per_worker:
      _checks.one_gradient_per_worker(
          bool(one_gradient_per_worker), worker_index,
          replicas_to_aggregate=replicas_to_aggregate,
          total_num_replicas=total_num_replicas, prompt_stop=prompt_stop)
    if (min_replicas_to_aggregate is not None
        or aggregation_deadline_secs is not None):
      _checks.deadline(min_replicas_to_aggregate, aggregation_deadline_secs,
                       replicas_to_aggregate=replicas_to_aggregate,
                       prompt_stop=prompt_stop)
    if (variable_averages is None) != (variables_to_average is None):
      raise ValueError(
          "variable_averages and variables_to_average go together: got "
          "variable_averages=%r and variables_to_average=%r. Pass both (an "
          "ExponentialMovingAverage and the list of variables it averages) or "
          "neither." % (variable_averages, variables_to_average))

    super().__init__(use_locking, name)
    _LOG.info("SyncReplicasV2: replicas_to_aggregate=%s; total_num_replicas=%s",
              replicas_to_aggregate, total_num_replicas)
    # Stock keeps the wrapped optimizer in ``_opt``; TensorFlow's own tests
    # read it, so the name stays.
    self._opt = opt
    self._replicas_to_aggregate = replicas_to_aggregate
    self._total_num_replicas = total_num_replicas
    self._variable_averages = variable_averages
    self._variables_to_average = variables_to_average
    self._tokens_per_step = _tokens.tokens_per_step(
        replicas_to_aggregate, total_num_replicas)
    self._prompt_stop = bool(prompt_stop)
    self._stall_log_secs = stall_log_secs
    self._stall_timeout_secs = stall_timeout_secs
    self._statistics = bool(statistics)
    self._fuse_dense_gradients = bool(fuse_dense_gradients)
    self._pack_gradient_transfers = bool(pack_gradient_transfers)
    self._averages_before_tokens = bool(averages_before_tokens)
    self._sparse_reduction = _checks.sparse_reduction(sparse_reduction)
    # A sum or a replica mean over rows is only right with unique rows.
    self._combine_sparse_duplicates = (
        bool(combine_sparse_duplicates)
        or self._sparse_reduction != _checks.ROW_MEAN)
    self._statistics_log_steps = statistics_log_steps or 0
    self._one_gradient_per_worker = bool(one_gradient_per_worker)
    self._worker_index = worker_index
    self._min_replicas_to_aggregate = min_replicas_to_aggregate
    self._aggregation_deadline_secs = aggregation_deadline_secs
    # Everything below is built by apply_gradients.
    self._global_step = None
    self._local_step = None
    self._sync_token_queue = None
    self._chief_queue_runner = None
    self._accumulators = []
    self._chief_init_op = None
    self._local_step_init_op = None
    self._ready_for_local_init_op = None
    self._status = None
    self._generations = None
    self._token_shared_name = None
    self._stats = None
    self._worker_queues = []
    self._status_scope = None

  # ---------------------------------------------------------------- accessors

  @property
  def is_built(self):
    """True once ``apply_gradients`` has built the synchronization ops."""
    return self._chief_queue_runner is not None

  @property
  def replicas_to_aggregate(self):
    return self._replicas_to_aggregate

  @property
  def total_num_replicas(self):
    return self._total_num_replicas

  @property
  def tokens_per_step(self):
    """Tokens the chief enqueues after each update."""
    return self._tokens_per_step

  @property
  def global_step(self):
    """The global step passed to ``apply_gradients``."""
    return self._built("global_step", self._global_step)

  @property
  def local_step(self):
    """This worker's ``sync_rep_local_step`` variable."""
    return self._built("local_step", self._local_step)

  @property
  def token_queue(self):
    """The ``sync_token_q`` queue."""
    return self._built("token_queue", self._sync_token_queue)

  @property
  def accumulators(self):
    """``(accumulator, device)`` pairs, one per variable with a gradient."""
    self._built("accumulators", self._chief_queue_runner)
    return [(a.accumulator, a.device) for a in self._accumulators]

  @property
  def fuse_dense_gradients(self):
    """True if dense gradients share one accumulator per ps task."""
    return self._fuse_dense_gradients

  @property
  def pack_gradient_transfers(self):
    """True if small dense gradients cross to each ps task as one tensor."""
    return self._pack_gradient_transfers

  @property
  def one_gradient_per_worker(self):
    """True if each worker has a token queue of its own."""
    return self._one_gradient_per_worker

  @property
  def worker_index(self):
    """This worker's index (only with ``one_gradient_per_worker``)."""
    return self._worker_index

  @property
  def min_replicas_to_aggregate(self):
    """The fewest gradients a deadline update applies (None: no deadline)."""
    return self._min_replicas_to_aggregate

  @property
  def aggregation_deadline_secs(self):
    return self._aggregation_deadline_secs

  @property
  def sparse_reduction(self):
    """``"row_mean"`` (stock), ``"replica_mean"`` or ``"sum"``."""
    return self._sparse_reduction

  @property
  def statistics(self):
    """True if built with ``statistics=True``."""
    return self._statistics

  @property
  def statistics_log_steps(self):
    """Session runs between the hook's statistics lines (0: never)."""
    return self._statistics_log_steps

  @property
  def statistics_tensors(self):
    """Statistics scalars by summary tag suffix (``"worker/tokens_taken"``).

    Empty when built with ``statistics=False``.
    """
    self._built("statistics_tensors", self._chief_queue_runner)
    return dict(self._stats.tensors) if self._stats is not None else {}

  def sync_manifest(self):
    """What a status tool needs to find this job's sync state on the ps.

    Returns:
      A JSON-serializable dict: ``replicas_to_aggregate``,
      ``tokens_per_step``, the global step's name, device, dtype and kind,
      the token queue's shared name and device, and one entry per
      accumulator (shared name, device, dtype, shape, dense or sparse).
    """
    self._built("sync_manifest", self._chief_queue_runner)
    return _manifest.build(
        accumulators=self._accumulators, global_step=self._global_step,
        replicas_to_aggregate=self._replicas_to_aggregate,
        total_num_replicas=self._total_num_replicas,
        tokens_per_step=self._tokens_per_step,
        token_queue_shared_name=self._token_shared_name,
        worker_token_queue_shared_names=[
            q.queue_ref.op.get_attr("shared_name").decode()
            for q in self._worker_queues],
        local_step=self._local_step,
        generations_shared_name=self._generations.shared_name)

  def write_sync_manifest(self, path):
    """Writes ``sync_manifest()`` as JSON for ``tools/status``.

    Args:
      path: A file, or a directory (e.g. the chief's checkpoint_dir) that
        gets ``sync_manifest.json``.

    Returns:
      The file written.
    """
    return _manifest.write(self.sync_manifest(), path)

  @property
  def chief_init_op(self):
    return self._built("chief_init_op", self._chief_init_op)

  @property
  def local_step_init_op(self):
    return self._built("local_step_init_op", self._local_step_init_op)

  @property
  def ready_for_local_init_op(self):
    return self._built("ready_for_local_init_op",
                       self._ready_for_local_init_op)

  def _built(self, what, value):
    if not self.is_built:
      raise errors.NotBuiltError(
          "SyncReplicasOptimizer.%s is only available after "
          "apply_gradients() (or minimize()) has been called on this "
          "optimizer." % what)
    return value

  # ------------------------------------------------------------------ build

  def _validate(self, grads_and_vars, global_step):
    """Checks every argument of apply_gradients before any op exists."""
    if self.is_built:
      raise RuntimeError(
          "apply_gradients() was already called on this SyncReplicasOptimizer "
          "(global step %s). Each instance builds one set of accumulators and "
          "one token queue; create one optimizer per train op."
          % self._global_step.name)
    _checks.apply_arguments(grads_and_vars, global_step)
    _accumulators.check_sparse_reduction(grads_and_vars, self._sparse_reduction)
    if (self._one_gradient_per_worker
        and global_step.dtype.base_dtype != tf.int64):
      # A restarted chief rolls an int32 step back to its checkpoint, below
      # the steps workers already pushed at; they would skip every token
      # until the step caught up, and with no backups nobody would push.
      # int64 steps carry the restart generation (_restart), which keeps new
      # tokens above every old step.
      raise ValueError(
          "one_gradient_per_worker=True needs an int64 global step, got %s "
          "of dtype %s. Use tf.compat.v1.train.get_or_create_global_step(), "
          "which makes an int64 one." % (global_step.name,
                                         global_step.dtype.base_dtype.name))

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Apply gradients to variables.

    Builds the accumulators, the chief's aggregate-apply-release op (run by
    its queue runner) and each worker's push-then-wait train op.

    Args:
      grads_and_vars: List of (gradient, variable) pairs as returned by
        compute_gradients().
      global_step: The int32/int64 global step variable; required, as it is
        what gradients' staleness is measured against.
      name: Accepted for API compatibility and, as in stock, unused: the ops
        are named after the optimizer's ``name``.

    Returns:
      train_op: The op that pushes this replica's gradients and waits for a
      token, which it stores as the replica's local step.

    Raises:
      ValueError: If grads_and_vars is empty or holds no gradient or an
        unknown gradient type, or if global_step is missing or not integer.
      RuntimeError: If called a second time on the same instance.
    """
    del name  # Stock ignores it too; op names must match stock's.
    grads_and_vars = tuple(grads_and_vars)
    self._validate(grads_and_vars, global_step)
    self._global_step = global_step

    # Ours, not stock's: one name scope for everything we add, so that no
    # stock op name changes.
    with tf.compat.v1.name_scope(""), tf.compat.v1.name_scope(
        None, self._name + "_status") as scope:
      own_scope = scope
    prefix = _tokens.shared_prefix(self._name)
    token_shared_name = prefix + _tokens.TOKEN_QUEUE_NAME
    generations = _restart.Generations(
        global_step, scope=own_scope,
        token_queue_shared_name=token_shared_name)

    # The anchor lands on this worker's device, and the local step with it:
    # each replica must own its local step, never share one on a ps.
    local_anchor = tf.no_op()
    with _compat.colocate_with_local_anchor(local_anchor):
      local_step = tf.compat.v1.Variable(
          initial_value=0,
          trainable=False,
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
          dtype=global_step.dtype.base_dtype,
          name="sync_rep_local_step")
    self._local_step = local_step
    stats = None
    if self._statistics:
      stats = _stats.Statistics(
          scope=own_scope, tag_prefix=self._name, global_step=global_step,
          local_step=local_step, local_anchor=local_anchor,
          generations=generations,
          colocate=_compat.colocate_with_local_anchor,
          deadline_updates=self._aggregation_deadline_secs is not None)
    # The worker's counters start with its local step: TF 0.12's Supervisor
    # recipe runs this op (or chief_init_op) instead of the local variables'
    # initializer. A control dependency keeps stock's op name.
    with tf.control_dependencies([stats.worker_init_op()] if stats else []):
      local_step_init_op = tf.compat.v1.assign(local_step, global_step)
    ready_for_local_init_op = (
        tf.compat.v1.report_uninitialized_variables(
            tf.compat.v1.global_variables()))
    # Most scripts never run it (only a Supervisor recipe does), and
    # TensorFlow then logs "Object was never used" at exit, for stock too.
    getattr(ready_for_local_init_op, "mark_used", lambda: None)()

    # What each take waits for: stock's constant, or with a deadline a value
    # the chief's runner feeds (the count that arrived by the deadline).
    num_required = self._replicas_to_aggregate
    if self._aggregation_deadline_secs is not None:
      with tf.compat.v1.name_scope(own_scope):
        num_required = tf.compat.v1.placeholder_with_default(
            tf.constant(self._replicas_to_aggregate, tf.int32), [],
            name="num_required")

    pushes = []
    aggregated = []
    with tf.compat.v1.name_scope(None, self._name):
      fused = {}
      if self._fuse_dense_gradients:
        fusable = [(stats.order_gradient(g) if stats else g, v)
                   for g, v in grads_and_vars
                   if g is not None and _fused.fusable(g, v)]
        for group in _fused.group_by_task(fusable):
          entry, averaged = _fused.build(
              group, name=self._name, local_step=local_step,
              replicas_to_aggregate=num_required)
          pushes.append(entry.push)
          self._accumulators.append(entry)
          for (_, var), grad in zip(group.pairs, averaged):
            fused[id(var)] = grad
      # What each variable's own accumulator is pushed, prepared on the
      # worker (None: passed through to the wrapped optimizer, as in stock).
      prepared = []
      for grad, var in grads_and_vars:
        if id(var) in fused or grad is None:
          prepared.append(None)
          continue
        if (self._combine_sparse_duplicates
            and _compat.is_sparse_gradient(grad)):
          # On the worker, so only the combined rows cross to the ps.
          grad = _accumulators.combine_duplicates(grad)
        if stats is not None:
          with tf.compat.v1.device(var.device):
            grad = stats.order_gradient(grad)
        prepared.append(grad)
      routed = [None] * len(prepared)
      if self._pack_gradient_transfers:
        routed = _packing.pack(
            zip(prepared, (var for _, var in grads_and_vars)),
            scope=own_scope + "packed_transfers/")
      for (_, var), grad, on_ps in zip(grads_and_vars, prepared, routed):
        if id(var) in fused:
          aggregated.append((fused[id(var)], var))
          continue
        with tf.compat.v1.device(var.device):
          if grad is None:
            aggregated.append((None, var))  # Passed through, as in stock.
            continue
          entry = _accumulators.build(
              on_ps if on_ps is not None else grad, var,
              local_step=local_step,
              replicas_to_aggregate=num_required,
              prefix=prefix, sparse_reduction=self._sparse_reduction)
        pushes.append(entry.push)
        aggregated.append((entry.take, var))
        self._accumulators.append(entry)

      with tf.compat.v1.device(global_step.device), \
          tf.compat.v1.name_scope(""):
        update_op = self._opt.apply_gradients(aggregated, global_step)

      with tf.compat.v1.device(global_step.device), \
          tf.compat.v1.name_scope(""):
        token_queue = _tokens.create_queue(global_step.dtype.base_dtype,
                                           shared_name=token_shared_name)
      worker_queues = []
      if self._one_gradient_per_worker:
        with tf.compat.v1.device(global_step.device), \
            tf.compat.v1.name_scope(own_scope):
          worker_queues = _tokens.create_worker_queues(
              global_step.dtype.base_dtype, self._total_num_replicas,
              shared_prefix=prefix)
      # The queue this worker takes its tokens from.
      own_queue = (worker_queues[self._worker_index] if worker_queues
                   else token_queue)

      with tf.compat.v1.device(global_step.device), \
          tf.compat.v1.name_scope(""):
        # Workers wait for a token only after all their pushes landed.
        after_pushes = stats.after_pushes(pushes) if stats else []
        with tf.control_dependencies(pushes + after_pushes):
          token = own_queue.dequeue()
          if worker_queues:
            with tf.compat.v1.name_scope(own_scope):
              token = _tokens.newer_token(own_queue, token,
                                          tf.identity(local_step))
        with tf.control_dependencies(
            [stats.after_token(token)] if stats else []):
          train_op = tf.compat.v1.assign(local_step, token)

        # Tokens go out only after the update (and the global step
        # increment) is done, so a token always carries the new step.
        averages_first = (self._variable_averages is not None
                          and self._averages_before_tokens)
        if averages_first:
          with tf.control_dependencies([update_op]), \
              tf.compat.v1.name_scope(""):
            update_op = self._variable_averages.apply(
                self._variables_to_average)
        with tf.control_dependencies([update_op]):
          if worker_queues:
            with tf.compat.v1.name_scope(own_scope):
              sync_op = _tokens.fill_each_op(worker_queues, global_step,
                                             encode=generations.encode)
          else:
            sync_op = _tokens.fill_op(token_queue, global_step,
                                      self._tokens_per_step,
                                      encode=generations.encode)
        if self._variable_averages is not None and not averages_first:
          with tf.control_dependencies([sync_op]), \
              tf.compat.v1.name_scope(""):
            sync_op = self._variable_averages.apply(
                self._variables_to_average)
        self._status = _status.build(
            self._accumulators, [token_queue] + worker_queues,
            replicas_to_aggregate=self._replicas_to_aggregate,
            token_device=global_step.device, scope=own_scope,
            starts=generations.starts)
        runner_op = sync_op
        if stats is not None:
          stats.finish(self._status)
          runner_op = stats.count_update(
              sync_op, by_deadline=(None if num_required is
                              self._replicas_to_aggregate else tf.less(
                                  num_required, self._replicas_to_aggregate)))
        close_worker_queues = None
        if worker_queues:
          with tf.compat.v1.name_scope(own_scope):
            close_worker_queues = tf.group(
                *[q.close(cancel_pending_enqueues=True) for q in worker_queues],
                name="close_worker_token_queues")
        # Stock's QueueRunner(token_queue, [sync_op]), made to stop promptly.
        chief_queue_runner = _runner.SyncQueueRunner(
            token_queue, runner_op, status=self._status,
            global_step=global_step, local_step=local_step,
            replicas_to_aggregate=self._replicas_to_aggregate,
            prompt_stop=self._prompt_stop,
            stall_log_secs=self._stall_log_secs,
            stall_timeout_secs=self._stall_timeout_secs,
            extra_close_op=close_worker_queues,
            deadline=(None if self._aggregation_deadline_secs is None else
                      _runner.Deadline(num_required,
                                       self._min_replicas_to_aggregate,
                                       self._aggregation_deadline_secs)))

      chief_init_op = tf.group(
          local_step_init_op,
          *_accumulators.set_global_step_ops(
              self._accumulators, global_step, generations=generations,
              after=generations.start_op, scope=own_scope),
          generations.drain_tokens_op(token_queue),
          *[generations.drain_tokens_op(q) for q in worker_queues],
          *([stats.init_op()] if stats else []))

    self._sync_token_queue = token_queue
    self._status_scope = own_scope
    self._worker_queues = worker_queues
    self._token_shared_name = token_shared_name
    self._generations = generations
    self._stats = stats
    self._local_step_init_op = local_step_init_op
    self._ready_for_local_init_op = ready_for_local_init_op
    self._chief_init_op = chief_init_op
    # Set last: is_built flips only once everything above exists.
    self._chief_queue_runner = chief_queue_runner
    return train_op

  # ------------------------------------------------------------ chief side

  def get_chief_queue_runner(self):
    """Returns the QueueRunner for the chief to execute.

    It aggregates gradients, applies them, increments the global step and
    releases the next tokens, in a loop.

    Raises:
      ValueError: If this is called before apply_gradients().
    """
    if not self.is_built:
      raise errors.NotBuiltError(
          "Should be called after apply_gradients(). Build the train op with "
          "minimize() or apply_gradients() first.")
    return self._chief_queue_runner

  def check_num_tokens(self, num_tokens):
    """Validates an initial token count; returns the count to enqueue.

    Args:
      num_tokens: -1 for stock's default (``replicas_to_aggregate``), or a
        count of at least ``replicas_to_aggregate - total_num_replicas``.

    Returns:
      The number of tokens the init op will enqueue.

    Raises:
      ValueError: If num_tokens is not an int or is too small, or is not -1
        with ``one_gradient_per_worker`` (each worker gets one token).
    """
    if self._one_gradient_per_worker and num_tokens != -1:
      raise ValueError(
          "With one_gradient_per_worker=True the chief gives every worker "
          "exactly one initial token (more would let a worker push twice at "
          "the first step); got num_tokens=%r. Pass -1 (the default)."
          % (num_tokens,))
    return _checks.init_tokens(
        num_tokens, replicas_to_aggregate=self._replicas_to_aggregate,
        total_num_replicas=self._total_num_replicas)

  def get_init_tokens_op(self, num_tokens=-1):
    """Returns the op to fill the sync_token_queue with the tokens.

    Run once by the chief at start so that workers can start their first
    step. Make sure ``num_tokens >= replicas_to_aggregate -
    total_num_replicas``.

    Args:
      num_tokens: Number of tokens to add to the queue; -1 adds
        ``replicas_to_aggregate``.

    Returns:
      An op for the chief/sync replica to fill the token queue.

    Raises:
      ValueError: If this is called before apply_gradients().
      ValueError: If num_tokens are smaller than replicas_to_aggregate -
        total_num_replicas.
    """
    if not self.is_built:
      raise errors.NotBuiltError(
          "get_init_tokens_op() should be called after apply_gradients().")
    count = self.check_num_tokens(num_tokens)
    if self._worker_queues:
      # One token of the current step per worker. A worker that starts now
      # pushes at that step without a token and then skips this one
      # (_tokens.newer_token); one still holding an older step (its chief
      # restarted) needs it to push again, or nobody would.
      with tf.compat.v1.device(self._global_step.device), \
          tf.compat.v1.name_scope(self._status_scope):
        return _tokens.fill_each_op(self._worker_queues, self._global_step,
                                    encode=self._generations.encode)
    if count > 0:
      # Every way of starting the protocol runs this op, not always
      # chief_init_op (a Supervisor's default local init skips it): the
      # cluster counters start here too, before any token exists.
      with tf.compat.v1.device(self._global_step.device), \
          tf.compat.v1.name_scope(""), tf.control_dependencies(
              [self._stats.init_op()] if self._stats else []):
        return _tokens.fill_op(self._sync_token_queue, self._global_step,
                               count, encode=self._generations.encode)
    return tf.no_op(name="no_init_tokens")

  def make_session_run_hook(self, is_chief, num_tokens=-1):
    """Creates a hook to handle SyncReplicasHook ops such as initialization.

    May be called before ``minimize()``; the hook reads the ops in
    ``begin()``. A chief's ``num_tokens`` is validated here already.
    """
    return hook_lib.SyncReplicasOptimizerHook(self, is_chief, num_tokens)

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

import collections
import logging
import sys
import typing

import tensorflow as tf

from sync_replicas import _accumulators
from sync_replicas import _averages
from sync_replicas import _checks
from sync_replicas import _compat
from sync_replicas import _data_end
from sync_replicas import _gone
from sync_replicas import _keras
from sync_replicas import _manifest
from sync_replicas import _options
from sync_replicas import _prefetch
from sync_replicas import _restart
from sync_replicas import _rewired_reads
from sync_replicas import _routes
from sync_replicas import _saves
from sync_replicas import _runner
from sync_replicas import _stats
from sync_replicas import _timeline
from sync_replicas import _status
from sync_replicas import _tokens
from sync_replicas import _train_runs
from sync_replicas import _transfer
from sync_replicas import _wrapped
from sync_replicas import hook as hook_lib

_LOG = logging.getLogger(__name__)

# Types of stock's arguments, for annotations. TensorFlow ships no type
# information: they tell readers, and type checkers read them as Any.
_Averages = typing.Optional[tf.train.ExponentialMovingAverage]
_Variables = typing.Optional[typing.Sequence[tf.Variable]]


def _say_built(replicas_to_aggregate, total_num_replicas):
  """What the constructor logs: stock's INFO line and, under the patch
  (sync-replicas-run), that a program run unchanged got ours (once)."""
  _LOG.info("SyncReplicasV2: replicas_to_aggregate=%s; total_num_replicas=%s",
            replicas_to_aggregate, total_num_replicas)
  # Looked up, not imported: no patch is loaded unless one was asked for.
  patch = sys.modules.get("sync_replicas.patch")
  if patch is not None and patch.is_installed():
    patch.built()


class SyncReplicasOptimizer(_data_end.AnnouncesDataEnd,
                            _wrapped.WrappedOptimizer):
  """Class to synchronize, aggregate gradients and pass them to the optimizer.

  A drop-in for ``tf.compat.v1.train.SyncReplicasOptimizer`` (its numbers
  with ``data_end="stock"``). Gradients are averaged, not summed: scale the
  learning rate as for a larger batch.

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
      accumulator's global step; after a restart it also empties the
      accumulators and token queues of what an earlier chief left.
    local_step_init_op: A non-chief's local init: its local step.
    ready_for_local_init_op: Lists uninitialized global variables; empty once
      the chief has initialized the model.
  """

  # What apply_gradients built (None before it), for type checkers.
  _state: "_Built | None"
  _chief_queue_runner: "tf.compat.v1.train.QueueRunner | None"

  def __init__(self,
               opt: typing.Any,
               replicas_to_aggregate: int,
               total_num_replicas: "int | None" = None,
               variable_averages: _Averages = None,
               variables_to_average: _Variables = None,
               use_locking: bool = False, name: str = "sync_replicas",
               *,
               prompt_stop: bool = True, stall_log_secs: "float | None" = 60.0,
               stall_timeout_secs: "float | None" = None,
               statistics: bool = False, timeline_dir: "str | None" = None,
               statistics_log_steps: "int | None" = 100,
               fuse_dense_gradients: bool = False, pack_gradient_transfers: bool = True,
               averages_before_tokens: bool = False,
               combine_sparse_duplicates: bool = False,
               sparse_reduction: str = "row_mean", data_end: str = "train_all",
               worker_gone_secs: "float | None" = None,
               one_gradient_per_worker: bool = False,
               worker_index: "int | None" = None,
               min_replicas_to_aggregate: "int | None" = None,
               aggregation_deadline_secs: "float | None" = None,
               pack_variable_reads: "bool | None" = None,
               transfer_dtype: "tf.DType | str | None" = None,
               prefetch_variable_reads: "bool | None" = None) -> None:
    """Construct a sync_replicas optimizer.

    Args:
      opt: The optimizer that computes and applies the gradients: a
        ``tf.compat.v1.train.Optimizer`` or (not in stock) a Keras 2 legacy one.
      replicas_to_aggregate: Replicas to aggregate for each variable update.
      total_num_replicas: Total number of tasks/workers/replicas. If greater
        than replicas_to_aggregate, the difference is backup replicas; if
        smaller, replicas compute several batches per update. Defaults to
        ``replicas_to_aggregate``.
      variable_averages: Optional ``ExponentialMovingAverage`` the chief
        applies after each update to ``variables_to_average`` (only with it).
      variables_to_average: The variables to average.
      use_locking: Passed to the base Optimizer (unused, as in stock).
      name: The name scope of the accumulator ops.
      **options: Not in stock, keyword-only (``_options.Options``, options.md).

    Raises:
      ValueError: For a bad replica count, a ``variable_averages`` without
        ``variables_to_average`` or the reverse, or a bad option (named).
      TypeError: If ``opt`` is no v1 ``Optimizer`` nor a Keras 2 legacy one.
    """
    extras = {k: v for k, v in locals().items() if k in _options.EXTRAS}
    r, t = _options.replica_counts(replicas_to_aggregate, total_num_replicas)
    opt = _keras.adapt(opt)  # A Keras 2 legacy one gets the v1 interface.
    _checks.v1_optimizer(opt)
    _options.check_extras(r, t, **extras)
    super().__init__(use_locking, name)
    _say_built(r, t)
    self._opt = opt  # Stock's name: TensorFlow's own tests read it.
    self._set_replica_counts(r, t)
    self._options = _options.make(r, t, **extras)
    prefix = _tokens.shared_prefix(name)
    self._tokens = _tokens.policy(self._options, shared_prefix=prefix)
    self._data_end = _data_end.make(self._options, shared_prefix=prefix)
    self._state = self._chief_queue_runner = None  # Set by apply_gradients.

  # ---------------------------------------------------------------- accessors

  @property
  def options(self) -> "_options.Options":
    """The frozen ``_options.Options`` this optimizer was built with."""
    return self._options

  @property
  def is_built(self) -> bool:
    """True once ``apply_gradients`` has built the synchronization ops."""
    return self._state is not None

  @property
  def global_step(self) -> tf.Variable:
    """The global step passed to ``apply_gradients``."""
    return self._built("global_step", self._state).global_step

  @property
  def local_step(self) -> tf.Variable:
    """This worker's ``sync_rep_local_step`` variable."""
    return self._built("local_step", self._state).local_step

  @property
  def token_queue(self) -> "tf.queue.FIFOQueue":
    """The ``sync_token_q`` queue."""
    return self._built("token_queue", self._state).tokens.token_queue

  @property
  def accumulators(self) -> "list[tuple[typing.Any, str]]":
    """``(accumulator, device)`` pairs, one per variable with a gradient."""
    return [(a.accumulator, a.device)
            for a in self._built("accumulators", self._state).accumulators]

  @property
  def statistics_tensors(self) -> "dict[str, tf.Tensor]":
    """Statistics scalars by tag suffix (``"worker/tokens_taken"``); empty
    when built with ``statistics=False``."""
    return dict(self._built("statistics_tensors", self._state).stats.tensors)

  @property
  def timeline(self) -> "_timeline.Timeline | _timeline.NoTimeline":
    """The timeline's marks (``_timeline``; ``NoTimeline`` without one)."""
    return self._built("timeline", self._state).timeline

  def runs_train_op(self, fetches: typing.Any) -> bool:
    """Not in stock: whether a run of ``fetches`` trains (they reach the
    train op), what the hook counts as a step. NotBuiltError before
    ``apply_gradients``."""
    built = self._built("runs_train_op", self._state)
    return built.train_runs.runs_train_op(fetches)

  def sync_manifest(self) -> "dict[str, typing.Any]":
    """What a status tool needs to find this job's sync state on the ps.

    Returns:
      A JSON-serializable dict: ``replicas_to_aggregate``,
      ``tokens_per_step``, the global step's name, device, dtype and kind,
      the token queue's shared name and device, and one entry per
      accumulator (shared name, device, dtype, shape, dense or sparse).
    """
    state = self._built("sync_manifest", self._state)
    return _manifest.build(
        accumulators=state.accumulators, global_step=state.global_step,
        replicas_to_aggregate=self.replicas_to_aggregate,
        total_num_replicas=self.total_num_replicas,
        tokens_per_step=self.tokens_per_step,
        token_queue_shared_name=state.tokens.shared_name,
        worker_token_queue_shared_names=state.tokens.worker_shared_names,
        local_step=state.local_step,
        generations_shared_name=state.generations.shared_name,
        done_workers_shared_name=self._data_end.shared_name)

  def write_sync_manifest(self, path: str) -> str:
    """Writes ``sync_manifest()`` as JSON for ``sync-replicas-status``.

    Args:
      path: A directory (e.g. the chief's checkpoint_dir) that gets
        ``sync_manifest.json``, created if it does not exist yet; or a file:
        one that exists, or a new one whose name ends in ``.json``.

    Returns:
      The file written.
    """
    return _manifest.write(self.sync_manifest(), path)

  @property
  def chief_init_op(self) -> tf.Operation:
    return self._built("chief_init_op", self._state).chief_init_op

  @property
  def local_step_init_op(self) -> tf.Operation:
    return self._built("local_step_init_op", self._state).local_step_init_op

  @property
  def ready_for_local_init_op(self) -> tf.Tensor:
    state = self._built("ready_for_local_init_op", self._state)
    return state.ready_for_local_init_op

  # ------------------------------------------------------------------ build

  def apply_gradients(
      self, grads_and_vars: "typing.Iterable[tuple[typing.Any, tf.Variable]]",
      global_step: "tf.Variable | None" = None,
      name: "str | None" = None) -> tf.Operation:
    """Apply gradients to variables.

    Builds the accumulators, the chief's aggregate-apply-release op (run by
    its queue runner) and each worker's push-then-wait train op, in stock's
    order (which fixes every op name; see docs/design.md).

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
    _validate(self, grads_and_vars, global_step)
    assert global_step is not None  # For type checkers: _validate raised.
    b = _Build(self, self.get_name(), self._tokens, self._data_end,
               global_step)
    b.packed_variable_reads(grads_and_vars)
    b.local_step_and_statistics()
    b.aggregation_count()
    with tf.compat.v1.name_scope(None, self.get_name()):
      b.gradient_routes(grads_and_vars)
      b.apply_averaged_gradients()
      b.token_queues()
      with tf.compat.v1.device(global_step.device), \
          tf.compat.v1.name_scope(""):
        train_op = b.worker_train_op()
        b.chief_sync_op()
        b.chief_runner()
      b.chief_init_op()
    # Set last: is_built flips only once everything exists.
    self._state = b.result()
    self._chief_queue_runner = self._state.chief_queue_runner
    return train_op

  # ------------------------------------------------------------ chief side

  def check_num_tokens(self, num_tokens: int) -> int:
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
    self._tokens.check_num_tokens(num_tokens)
    return _checks.init_tokens(
        num_tokens, replicas_to_aggregate=self.replicas_to_aggregate,
        total_num_replicas=self.total_num_replicas)

  def _build_init_tokens_op(self, num_tokens):
    """The initial fill (``_tokens``); ``get_init_tokens_op`` guards it.

    With ``data_end="train_all"`` the default ``-1`` enqueues, on the
    job's first start, only the tokens the workers lack
    (docs/data_end.md).
    """
    count = self.check_num_tokens(num_tokens)
    return _init_tokens_op(self._state, self._data_end, count,
                           default=num_tokens == -1)

  def make_checkpoint_saver_listener(
      self, timeout_secs: float = _saves.DEFAULT_TIMEOUT_SECS
  ) -> "_saves.SavePauseListener":
    """Not in stock: a ``CheckpointSaverListener`` that keeps the chief's
    updates out of its checkpoint saves, so that none holds half an update.
    Pass it, first, to the chief's ``CheckpointSaverHook(listeners=...)``;
    a save waits at most ``timeout_secs`` for the update being applied.
    See docs/operations.md. Raises ``ValueError`` before
    ``apply_gradients()``, with ``prompt_stop=False`` or a bad timeout."""
    runner = self.get_chief_queue_runner()  # Raises before the build.
    return _saves.SavePauseListener(runner.updates, timeout_secs)

  def make_session_run_hook(
      self, is_chief: bool,
      num_tokens: int = -1) -> "hook_lib.SyncReplicasOptimizerHook":
    """Creates a hook to handle SyncReplicasHook ops such as initialization.

    May be called before ``minimize()``; the hook reads the ops in
    ``begin()``. A chief's ``num_tokens`` is validated here already.
    """
    return hook_lib.SyncReplicasOptimizerHook(self, is_chief, num_tokens)


def _init_tokens_op(state, data_end, count, *, default):
  """``get_init_tokens_op``'s op: ``count`` tokens (cut by ``data_end`` on
  the first start when the count is the ``default``), or a no-op."""
  # Every way of starting the protocol runs this op, not always
  # chief_init_op (a Supervisor's default local init skips it): the
  # cluster counters start here too, before any token exists.
  encode = data_end.encoding(state.generations, scope=state.scope,
                             initial=default)
  fill = state.tokens.initial_fill(
      state.global_step, count, encode=encode, after=state.stats.init_ops)
  return fill if fill is not None else tf.no_op(name="no_init_tokens")


def _validate(opt, grads_and_vars, global_step):
  """Checks every argument of apply_gradients before any op exists."""
  if opt.is_built:
    raise RuntimeError(
        "apply_gradients() was already called on this SyncReplicasOptimizer "
        "(global step %s). Each instance builds one set of accumulators and "
        "one token queue; create one optimizer per train op."
        % opt.global_step.name)
  _checks.apply_arguments(grads_and_vars, global_step)
  _accumulators.check_sparse_reduction(grads_and_vars,
                                       opt.options.sparse_reduction)
  if opt.options.one_gradient_per_worker:
    _checks.int64_global_step(global_step)


# What apply_gradients built, read by the accessors.
_Built = collections.namedtuple("_Built", [
    "global_step", "local_step", "tokens", "accumulators", "generations",
    "stats", "scope", "local_step_init_op", "ready_for_local_init_op",
    "chief_init_op", "chief_queue_runner", "timeline", "train_runs"])


class _Build:
  """The stages of one ``apply_gradients``, each building one protocol part.

  ``SyncReplicasOptimizer.apply_gradients`` calls them in stock's order
  (which fixes every op name); each stage takes what earlier ones made from
  this object, where they left it.
  """

  def __init__(self, optimizer, name, tokens, data_end, global_step):
    """Our name scope and the restart generations (nothing stock's yet)."""
    self.wrapped = optimizer._opt  # pylint: disable=protected-access
    self.o = optimizer.options
    self.name = name
    self.global_step = global_step
    # Ours, not stock's: one name scope for everything we add, so that no
    # stock op name changes.
    with tf.compat.v1.name_scope(""), tf.compat.v1.name_scope(
        None, name + "_status") as scope:
      self.scope = scope
    self.tokens = tokens
    self.data_end = data_end
    # How float32 tensors cross between tasks (transfer_dtype).
    self.wire = _transfer.codec(self.o.transfer_dtype, scope=scope)
    self.generations = _restart.Generations(
        global_step, scope=scope,
        token_queue_shared_name=self.tokens.shared_name)

  def packed_variable_reads(self, grads_and_vars):
    """The model's reads rerouted, before any op of ours reads a variable."""
    # What it did is logged; nothing later needs it but the copies, which
    # the local init and the train op fill (prefetch_variable_reads).
    self.prefetched = _prefetch.policy(self.o.prefetch_variable_reads,
                                       wire=self.wire, scope=self.scope)
    _rewired_reads.policy(self.o.pack_variable_reads).build(
        grads_and_vars, scope=self.scope, wire=self.wire,
        prefetched=(self.prefetched if self.o.prefetch_variable_reads
                    else None))

  def local_step_and_statistics(self):
    """The worker-local step, the statistics and the workers' local init."""
    gs = self.global_step
    # The anchor lands on this worker's device, and the local step with it:
    # each replica must own its local step, never share one on a ps.
    local_anchor = tf.no_op()
    with _compat.colocate_with_local_anchor(local_anchor):
      self.local_step = tf.compat.v1.Variable(
          initial_value=0,
          trainable=False,
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
          dtype=gs.dtype.base_dtype,
          name="sync_rep_local_step")
    self.stats = _stats.build(
        self.o.statistics, scope=self.scope, tag_prefix=self.name,
        global_step=gs, local_step=self.local_step,
        local_anchor=local_anchor, generations=self.generations,
        colocate=_compat.colocate_with_local_anchor,
        deadline_updates=self.o.has_deadline)
    self.timeline = _timeline.build(
        self.o.timeline_dir, scope=self.scope, local_anchor=local_anchor)
    # The worker's counters start with its local step: TF 0.12's Supervisor
    # recipe runs this op (or chief_init_op) instead of the local variables'
    # initializer. A control dependency keeps stock's op name.
    with tf.control_dependencies(self.stats.worker_init_ops()):
      # Read here, as stock's assign reads it, so that stock's op names
      # stay; the generation's offset is added in our scope.
      self.local_step_init_op = tf.compat.v1.assign(
          self.local_step,
          self.generations.local_step_value(tf.convert_to_tensor(gs)))
    # A new session's copies: read fresh, after the local step (so never
    # older than it). Without copies the op stays stock's assign.
    primed = self.prefetched.prime([self.local_step_init_op])
    if primed:
      with tf.compat.v1.name_scope(self.scope):
        self.local_step_init_op = tf.group(
            self.local_step_init_op, *primed, name="local_step_init")
    self.ready_for_local_init_op = (
        tf.compat.v1.report_uninitialized_variables(
            tf.compat.v1.global_variables()))
    # Most scripts never run it (only a Supervisor recipe does), and
    # TensorFlow then logs "Object was never used" at exit, for stock too.
    getattr(self.ready_for_local_init_op, "mark_used", lambda: None)()

  def aggregation_count(self):
    """What each take waits for, and the chief's loop that feeds it.

    Stock's constant and blocking loop, or with a deadline a count the
    chief's runner feeds (what arrived by the deadline).
    """
    r = self.o.replicas_to_aggregate
    if not self.o.has_deadline:
      self.num_required = r
      return
    with tf.compat.v1.name_scope(self.scope):
      self.num_required = tf.compat.v1.placeholder_with_default(
          tf.constant(r, tf.int32), [], name="num_required")

  def chief_loop(self):
    """How the chief's runner runs the sync op once the takes exist.

    Stock's blocking loop, unless an update may need fewer than
    ``replicas_to_aggregate`` gradients (a deadline, or workers done): then
    a polling loop that feeds every take its count.
    """
    if not self.o.has_deadline and not self.data_end.enabled:
      return _runner.BlockingLoop()
    return _runner.PollingLoop(
        _data_end.take_counts(self.routes.aggregated),
        replicas_to_aggregate=self.o.replicas_to_aggregate,
        data_end=self.data_end if self.data_end.enabled else None,
        min_replicas=self.o.min_replicas_to_aggregate,
        secs=self.o.aggregation_deadline_secs,
        num_required=self.num_required if self.o.has_deadline else None,
        gone=_gone.make_watches(
            self.o.worker_gone_secs,
            ends=self.data_end if self.data_end.enabled else None,
            global_step=self.global_step, local_step=self.local_step,
            token=self.token_for_a_return()))

  def token_for_a_return(self):
    """With ``worker_gone_secs`` and the shared token queue: one token of
    the current step, which the chief enqueues when a gone worker is taken
    back at a push (that push's token came from a release cut to the
    others); None otherwise (a worker's own queue gets every release)."""
    if not self.o.worker_gone_secs or not self.data_end.shared_tokens:
      return None
    return self.tokens.initial_fill(
        self.global_step, 1, encode=self.generations.encode, after=list)

  def gradient_routes(self, grads_and_vars):
    """Every gradient's accumulator, its push and its take."""
    self.gradients = _timeline.gradient_tensors(grads_and_vars)
    self.routes = _routes.build(
        grads_and_vars, options=self.o, stats=self.stats,
        name=self.name, prefix=_tokens.shared_prefix(self.name),
        scope=self.scope, local_step=self.local_step,
        num_required=self.num_required, wire=self.wire)
    self.wire.log()  # What crosses in 16 bits: the reads and these.

  def apply_averaged_gradients(self):
    """The wrapped optimizer's update, on the global step's device."""
    with tf.compat.v1.device(self.global_step.device), \
        tf.compat.v1.name_scope(""):
      self.update_op = self.wrapped.apply_gradients(self.routes.aggregated,
                                                    self.global_step)

  def token_queues(self):
    self.tokens.create(self.global_step, scope=self.scope)
    self.data_end.build(device=self.global_step.device, scope=self.scope,
                        token_queue=self.tokens.token_queue,
                        local_step=self.local_step)

  def worker_train_op(self):
    """Push, then wait for a token and store it: the worker's barrier."""
    # Workers wait for a token only after all their pushes landed.
    pushed = self.stats.after_pushes(self.routes.pushes)
    token = self.tokens.take(self.routes.pushes + pushed.ops, self.local_step)
    step, counted = self.stats.after_token(token, pushed)
    # The next step's variables, read on the ps once the token is out
    # (prefetch_variable_reads): they cross with it.
    refreshed = self.prefetched.refresh([token])
    with tf.control_dependencies(list(counted) + refreshed):
      train_op = tf.compat.v1.assign(self.local_step, step)
    # The one test of which session runs train, shared by everything that
    # adds fetches to them or counts them (the hook, the timeline, the
    # data end's record).
    self.train_runs = _train_runs.TrainRuns(train_op)
    self.timeline.worker(self.gradients, self.routes.pushes, token,
                         self.local_step, train_runs=self.train_runs)
    if self.data_end.enabled:
      self.data_end.local_steps.record(token, train_runs=self.train_runs)
    return train_op

  def chief_sync_op(self):
    """The update, then the tokens (and the averages, in their place)."""
    averages = _averages.Averages(
        self.o.variable_averages, self.o.variables_to_average,
        before_tokens=self.o.averages_before_tokens)
    # Tokens go out only after the update (and the global step increment)
    # is done, so a token always carries the new step.
    with tf.control_dependencies([averages.before_tokens(self.update_op)]):
      released = self.tokens.release(self.global_step,
                                     encode=self.data_end.encoding(
                                         self.generations, scope=self.scope))
    self.sync_op = averages.after_tokens(released)
    self.timeline.chief(_timeline.gradient_tensors(self.routes.aggregated),
                        self.update_op, self.sync_op, self.global_step)

  def chief_runner(self):
    """The status ops, the statistics' last part, and the chief's runner."""
    self.loop = self.chief_loop()
    self.status = _status.build(
        self.routes.accumulators, self.tokens.queues,
        replicas_to_aggregate=self.o.replicas_to_aggregate,
        token_device=self.global_step.device, scope=self.scope,
        starts=self.generations.starts)
    done = gone = None
    if self.data_end.enabled:
      done = self.data_end.done_count
    if self.o.worker_gone_secs:
      # The record holds the gone workers' marks beside the done ones.
      gone = self.data_end.gone_marks.count
      done = done - gone
    self.stats.finish(self.status, workers_done=done, workers_gone=gone)
    runner_op = self.stats.count_update(self.sync_op,
                                        by_deadline=self.loop.by_deadline)
    # Stock's QueueRunner(token_queue, [sync_op]), made to stop promptly.
    self.runner = _runner.SyncQueueRunner(
        self.tokens.token_queue, runner_op, status=self.status,
        global_step=self.global_step, local_step=self.local_step,
        replicas_to_aggregate=self.o.replicas_to_aggregate,
        prompt_stop=self.o.prompt_stop, stall_log_secs=self.o.stall_log_secs,
        stall_timeout_secs=self.o.stall_timeout_secs,
        extra_close_op=self.tokens.close_op(), loop=self.loop,
        timeline=self.timeline)

  def chief_init_op(self):
    """The chief's local init: local step, accumulators, restart state."""
    # Read once after this start's start_op, shared by everything below.
    start = self.generations.chief_start(self.global_step)
    self.chief_init = tf.group(
        self.local_step_init_op,
        *self.generations.chief_local_step_ops(
            self.local_step, start, after=[self.local_step_init_op]),
        *_accumulators.set_global_step_ops(
            self.routes.accumulators, self.global_step, start=start,
            after=self.generations.start_op, scope=self.scope),
        *self.tokens.drain_ops(start.restarted,
                               after=[self.generations.start_op]),
        *self.stats.init_ops())

  def result(self):
    return _Built(
        self.global_step, self.local_step, self.tokens,
        self.routes.accumulators, self.generations, self.stats, self.scope,
        self.local_step_init_op, self.ready_for_local_init_op,
        self.chief_init, self.runner, self.timeline, self.train_runs)

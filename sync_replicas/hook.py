"""SyncReplicasOptimizerHook: runs the sync optimizer's per-session set-up.

Owns what happens when a MonitoredSession (or an Estimator) creates a session:
wait until the chief has initialized the model, run the replica's local init
op, and on the chief enqueue the initial tokens and start the queue runner that
aggregates and applies gradients. It talks to the optimizer only through its
public accessors. With the optimizer's ``statistics``, it also reads the
statistics after every ``statistics_log_steps``-th train run, in a run of
their own (``_stats.StatsLogger`` says why), and logs them. A train run is
one whose fetches reach the train op (``optimizer.runs_train_op``): the one
rule for every count and fetch of the hook's, so that a script's own reads
between steps count as nothing.
"""

import logging
import sys
import typing

import tensorflow as tf

from sync_replicas import _compat
from sync_replicas import _runner
from sync_replicas import _stats
from sync_replicas import _timeline_hook
from sync_replicas import errors

if typing.TYPE_CHECKING:  # The optimizer module imports this one.
  from sync_replicas import optimizer as optimizer_lib

_LOG = logging.getLogger(__name__)

#: How long a recreated chief session waits for the previous session's sync
#: loop to end (``SyncQueueRunner.wait_for_earlier_sessions``), in seconds.
#: It ends once its own session closed, a few seconds at most even with a
#: ps unreachable (the token queue's close is bounded at 5 s).
EARLIER_LOOP_TIMEOUT_SECS = 30
#: The key of the local-step record among the hook's fetches.
_LOCAL_STEP_KEY = "sync_replicas_local_step"


class SyncReplicasOptimizerHook(tf.compat.v1.train.SessionRunHook):
  """A SessionRunHook handles ops related to SyncReplicasOptimizer.

  Create it with ``optimizer.make_session_run_hook(is_chief)``, before or
  after ``minimize()``; pass it to every worker's MonitoredTrainingSession (or
  ``Estimator.train(hooks=...)``).
  """

  def __init__(self, sync_optimizer: "optimizer_lib.SyncReplicasOptimizer",
               is_chief: bool, num_tokens: int = -1) -> None:
    """Creates hook to handle SyncReplicasOptimizer initialization ops.

    Args:
      sync_optimizer: The ``SyncReplicasOptimizer`` this hook initializes.
      is_chief: Whether this replica is the chief, which initializes the
        accumulators, enqueues the initial tokens and runs the queue runner.
      num_tokens: Initial tokens the chief enqueues; -1 for
        ``replicas_to_aggregate``. Ignored on non-chiefs, as in stock.

    Raises:
      ValueError: On the chief, if ``num_tokens`` is too small to finish the
        first step (checked now, not at session creation).
    """
    if is_chief:
      sync_optimizer.check_num_tokens(num_tokens)
    self._sync_optimizer = sync_optimizer
    self._is_chief = bool(is_chief)
    self._num_tokens = num_tokens
    # Set by begin(), which a session runs before every other callback.
    self._local_init_op: tf.Operation = None
    self._ready_for_local_init_op = None
    self._q_runner = None
    self._init_tokens_op = None
    self._stats_logger: "_stats.StatsLogger | None" = None
    self._timeline = None
    # The chief's runs, for its runner's stop: recovery or end of training.
    self._run_state = None
    # A run began and did not return (it raised): at end(), the input ended.
    self._open_run = False
    # Train runs (``runs_train_op``) that returned, for the data-end log
    # line; a script's own reads between steps are not counted.
    self._train_steps = 0
    self._train_run = False  # The run in flight trains.
    self._coord = None
    # A non-chief's watch on the chief while a train run waits for a token
    # (``_lost.ChiefWatch``), per session; None on the chief or without it.
    self._chief_watch = None

  @property
  def is_chief(self) -> bool:
    return self._is_chief

  def begin(self) -> None:
    opt = self._sync_optimizer
    if not opt.is_built:
      raise errors.NotBuiltError(
          "SyncReplicasOptimizer.apply_gradient should be called before using "
          "the hook. Build the train op with minimize() or apply_gradients() "
          "before the session is created.")
    self._ready_for_local_init_op = opt.ready_for_local_init_op
    if self._is_chief:
      self._local_init_op = opt.chief_init_op
      self._q_runner = opt.get_chief_queue_runner()
      self._init_tokens_op = opt.get_init_tokens_op(self._num_tokens)
    else:
      self._local_init_op = opt.local_step_init_op
      self._q_runner = None
      self._init_tokens_op = None
    self._stats_logger = None
    self._timeline = _timeline_hook.WorkerTimeline.of(opt.timeline)
    options = opt.options
    if options.statistics and options.statistics_log_steps:
      self._stats_logger = _stats.StatsLogger(
          opt.statistics_tensors, every_steps=options.statistics_log_steps,
          is_chief=self._is_chief)

  def after_create_session(self, session: "tf.compat.v1.Session",
                           coord: "tf.train.Coordinator") -> None:
    """Runs SyncReplicasOptimizer initialization ops."""
    self._coord = coord
    self._open_run = False
    if self._q_runner is not None and not (
        self._q_runner.wait_for_earlier_sessions(EARLIER_LOOP_TIMEOUT_SECS)):
      _LOG.warning(
          "sync_replicas: the sync loop of the chief's previous session is "
          "still running after %d s; the chief's init may wait for its take",
          EARLIER_LOOP_TIMEOUT_SECS)
    ready, msg = _compat.check_ready(
        self._ready_for_local_init_op, session,
        "Model is not ready for SyncReplicasOptimizer local init.")
    if not ready:
      raise RuntimeError(
          "Init operations did not make model ready for SyncReplicasOptimizer "
          "local_init. Init op: %s, error: %s"
          % (self._local_init_op.name, msg))
    session.run(self._local_init_op)
    # Where this worker's task is, for the chief's stall line (data_end).
    self._sync_optimizer.record_task_address(session)
    if self._q_runner is not None:
      # Before any token and before the loop: an update must not wait for
      # a worker whose end a restarted ps forgot (data_end).
      ends = self._q_runner.data_end
      if ends is not None:
        ends.restore(session)
        # A job that failed left the token queue closed on this ps, where
        # no initial token can go: say why, not the enqueue's CancelledError
        # (docs/operations.md, "A job that failed").
        failed = ends.abort.read(session, chief=True)
        if failed is not None:
          raise failed
    if self._timeline is not None:
      self._timeline.session_started(session)
    self._chief_watch = None
    if not self._is_chief:
      # The chief lost for good: named before the operation timeout ends
      # this worker's run (docs/operations.md, "The chief lost for good").
      self._chief_watch = self._sync_optimizer.chief_watch(session)
      if self._chief_watch is not None:
        watch = self._chief_watch.thread(session, coord)
        coord.register_thread(watch)
        watch.start()
    if self._init_tokens_op is not None:
      session.run(self._init_tokens_op)
    if self._stats_logger is not None:
      self._stats_logger.prepare(session)
    if self._q_runner is not None:
      self._run_state = _runner.ChiefRunState()
      self._q_runner.follow_runs(session, self._run_state)
      self._q_runner.create_threads(
          session, coord=coord, daemon=True, start=True)

  def before_run(
      self, run_context: "tf.compat.v1.train.SessionRunContext"
  ) -> "tf.compat.v1.train.SessionRunArgs | None":
    self._open_run = True
    if self._run_state is not None:
      self._run_state.in_run = self._run_state.ran = True
    fetches: "dict[str, typing.Any]" = {}
    marks = (self._timeline.before_run(run_context.original_args.fetches)
             if self._timeline is not None else None)
    if marks:
      fetches[_timeline_hook.KEY] = marks
    self._train_run = self._sync_optimizer.runs_train_op(
        run_context.original_args.fetches)
    record = self._sync_optimizer.data_end_fetches(
        run_context.original_args.fetches)
    if record is not None:
      # This worker's new local step, kept on the ps by the run's own ps
      # partition, for the chief's stall line (data_end).
      fetches[_LOCAL_STEP_KEY] = record
      if self._chief_watch is not None:
        self._chief_watch.run_started()
    return tf.compat.v1.train.SessionRunArgs(fetches) if fetches else None

  def after_run(
      self, run_context: "tf.compat.v1.train.SessionRunContext",
      run_values: "tf.compat.v1.train.SessionRunValues") -> None:
    self._open_run = False
    if self._train_run:
      self._train_steps += 1
    if self._chief_watch is not None:
      self._chief_watch.run_ended()
    if self._run_state is not None:
      self._run_state.in_run = False
    results = dict(run_values.results or {})
    results.pop(_LOCAL_STEP_KEY, None)
    if self._timeline is not None:
      self._timeline.after_run(results.pop(_timeline_hook.KEY, None))
    if self._stats_logger is not None and self._train_run:
      self._stats_logger.after_train_step(run_context.session)

  def end(self, session: "tf.compat.v1.Session") -> None:
    """MonitoredSession calls it only when training ends, never when it
    recreates the session after an error in a run: the chief's runner then
    closes the token queue (workers end), and otherwise keeps it open.

    MonitoredSession ends normally on a run that raised OutOfRangeError or
    StopIteration, the end of a one-pass input, and that run got no
    ``after_run``; a step limit's last run did. So a run still open here
    means this worker's data ended: it tells the job (``data_end``), and
    the chief keeps its sync loop running until every worker is done.
    """
    if self._open_run:
      self._open_run = False
      coord = self._coord
      # A run ended by the token queue the chief closed when the job
      # failed: this worker fails too, with the chief's reason (_abort).
      failed = (None if self._is_chief
                else self._sync_optimizer.chief_stop_error(session))
      if failed is not None:
        _LOG.error("sync_replicas: %s", failed)
        if coord is not None and not coord.should_stop():
          # MonitoredSession's close raises it, once every hook's end ran.
          coord.request_stop(_raised(failed))
          return
        raise failed
      self._sync_optimizer.announce_data_end(
          session, is_chief=self._is_chief, batches=self._train_steps,
          should_stop=lambda: coord is not None and coord.should_stop())
    if self._run_state is not None:
      self._run_state.ended = True


def _raised(error):
  """``error`` as the ``exc_info`` tuple ``Coordinator.request_stop`` takes
  outside an ``except`` block (raised once, so that it carries a
  traceback)."""
  try:
    raise error
  except Exception:  # pylint: disable=broad-except
    return sys.exc_info()

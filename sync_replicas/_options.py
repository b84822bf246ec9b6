"""The optimizer's options as one frozen value, validated once.

Owns the checks of every constructor argument of ``SyncReplicasOptimizer``
that is not the wrapped optimizer, in the order the constructor always made
them, and the values derived from them (tokens per step, whether sparse
duplicates are combined, whether a deadline is set). Everything is checked
here, before any op exists; the build reads the result and never re-checks.
The words of each error are ``_checks``'.
"""

import dataclasses
import numbers
from typing import Any, Optional

from sync_replicas import _checks
from sync_replicas import _prefetch
from sync_replicas import _rewired_reads
from sync_replicas import _data_end
from sync_replicas import _gone
from sync_replicas import _timeline
from sync_replicas import _tokens
from sync_replicas import _transfer


@dataclasses.dataclass(frozen=True)
class Options:
  """What a ``SyncReplicasOptimizer`` was built with: ``optimizer.options``.

  The stock arguments are the constructor's; every other one is keyword-only
  there and not in stock.

  Attributes:
    replicas_to_aggregate: Gradients each update averages.
    total_num_replicas: Workers in the job (``replicas_to_aggregate`` when
      the constructor got None).
    variable_averages: The ``ExponentialMovingAverage``, or None.
    variables_to_average: What it averages, or None.
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
      this many train steps (session runs whose fetches reach the train
      op; a script's other runs do not count); 0 or None: never.
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
      present when they run, which may be more than the count logged. None
      (default): always wait for ``replicas_to_aggregate``, as stock does.
    aggregation_deadline_secs: Not in stock. The deadline for the above;
      set both or neither. Needs ``prompt_stop=True``.
    timeline_dir: Not in stock. A directory where each task writes when
      every phase of every update happened (its gradients, push and token
      wait; the chief's wait for gradients, apply and token release), for
      ``sync-replicas-timeline`` to merge into one trace. None
      (default): the environment variable ``SYNC_REPLICAS_TIMELINE`` if set,
      else no timeline and nothing of it in the graph.
    pack_variable_reads: Not in stock. True: at the start of
      ``apply_gradients`` the reads of the trained variables that another
      task consumes (the worker's forward pass and its gradient ops) are
      rerouted to one packed read per (ps task, dtype), whoever built the
      model (``_rewired_reads``); same numbers, one transfer instead of one
      per variable. False: the model's graph is left as it is. The
      constructor's None (default) reads the environment variable
      ``SYNC_REPLICAS_PACK_VARIABLE_READS`` (1 or 0; unset: False).
    data_end: Not in stock. What happens when a worker's input ends
      (its one-pass input raises OutOfRange, which ends its MonitoredSession
      normally; a Supervisor loop calls ``announce_data_end``):
      ``"train_all"`` (default): the worker says it is done, later updates
      need only ``min(replicas_to_aggregate, workers not done)`` gradients,
      and a chief whose data ended keeps running updates until every worker
      is done; ``"stop_together"``: every worker stops at once, at the same
      global step; ``"stock"``: stock's behaviour (the others wait for the
      gone worker's gradient). See docs/data_end.md. Needs
      ``prompt_stop=True`` unless ``"stock"``.
    transfer_dtype: Not in stock. ``tf.bfloat16`` or ``tf.float16``: every
      float32 gradient a worker pushes, and with ``pack_variable_reads``
      every packed read of float32 variables, crosses in that dtype, cast
      where it was made and cast back to float32 where it arrives; the
      accumulators, the averages, the update and the variables stay
      float32 (``_transfer`` says what is rounded where). None (stored when
      off): the graph without it. The constructor's None (default) reads
      the environment variable ``SYNC_REPLICAS_TRANSFER_DTYPE`` (bfloat16,
      float16 or float32; unset: off); ``tf.float32`` is off whatever the
      environment says.
    prefetch_variable_reads: Not in stock. True: the packed reads of the
      variables that only the gradients consume are made on the ps right
      after the worker's token is dequeued and kept in worker-local copies
      that the next step reads (``_prefetch``): the values cross with the
      token, two dependent trips a step instead of three. Same numbers and
      staleness rule; a new session reads fresh (its local init fills the
      copies). Implies ``pack_variable_reads``. False: reads as
      ``pack_variable_reads`` says. The constructor's None (default) reads
      the environment variable ``SYNC_REPLICAS_PREFETCH_VARIABLE_READS``
      (1 or 0; unset: False).
    worker_gone_secs: Not in stock. A number of seconds: a worker whose
      gradient an update has waited for this long (with backups or a
      deadline: that has not pushed for this long while the updates went on
      without it), and whose task does not
      answer (refused, silent or unreachable), is declared gone (one log
      line on the chief); from then on an update needs
      ``min(replicas_to_aggregate, workers neither done nor gone)``
      gradients, as for a done worker. It is taken back when its task starts
      again or pushes again (one log line). Needs ``data_end="train_all"``.
      None (stored when off): wait for it, as stock does. The constructor's
      None (default) reads the environment variable
      ``SYNC_REPLICAS_WORKER_GONE_SECS`` (seconds; unset or empty: off).
      See docs/operations.md.
  """

  replicas_to_aggregate: int
  total_num_replicas: int
  variable_averages: Any = None
  variables_to_average: Any = None
  prompt_stop: bool = True
  stall_log_secs: Optional[float] = 60.0
  stall_timeout_secs: Optional[float] = None
  statistics: bool = False
  statistics_log_steps: int = 100
  fuse_dense_gradients: bool = False
  pack_gradient_transfers: bool = True
  averages_before_tokens: bool = False
  combine_sparse_duplicates: bool = False
  sparse_reduction: str = _checks.ROW_MEAN
  one_gradient_per_worker: bool = False
  worker_index: Optional[int] = None
  min_replicas_to_aggregate: Optional[int] = None
  aggregation_deadline_secs: Optional[float] = None
  timeline_dir: Optional[str] = None
  pack_variable_reads: bool = False
  data_end: str = _data_end.TRAIN_ALL
  transfer_dtype: Any = None
  prefetch_variable_reads: bool = False
  worker_gone_secs: Optional[float] = None

  @property
  def tokens_per_step(self) -> int:
    """Tokens the chief releases after each update."""
    return _tokens.tokens_per_step(self.replicas_to_aggregate,
                                   self.total_num_replicas)

  @property
  def has_deadline(self) -> bool:
    """True with ``min_replicas_to_aggregate``/``aggregation_deadline_secs``."""
    return self.aggregation_deadline_secs is not None


#: The constructor arguments ``make`` takes besides the two replica counts.
EXTRAS = tuple(
    f.name for f in dataclasses.fields(Options)
    if f.name not in ("replicas_to_aggregate", "total_num_replicas"))


def replica_counts(replicas_to_aggregate, total_num_replicas):
  """The two replica counts, checked; ``total_num_replicas`` defaulted."""
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
  return replicas_to_aggregate, total_num_replicas


def _seconds_or_none(knob, value):
  if value is not None and (isinstance(value, bool) or not isinstance(
      value, numbers.Real) or value < 0):
    raise ValueError(
        "%s must be a number of seconds >= 0 or None, got %r." %
        (knob, value))


def _log_steps(value):
  if value is not None and (
      isinstance(value, bool) or not isinstance(value, numbers.Integral)
      or value < 0):
    raise ValueError(
        "statistics_log_steps must be an int >= 0 or None, got %r. Pass how "
        "many train steps apart the hook logs statistics, or 0 for never."
        % (value,))


def check_extras(r, t, *, variable_averages, variables_to_average,
                 prompt_stop, stall_log_secs, stall_timeout_secs,
                 statistics_log_steps, one_gradient_per_worker, worker_index,
                 min_replicas_to_aggregate, aggregation_deadline_secs,
                 timeline_dir, pack_variable_reads, data_end, transfer_dtype,
                 prefetch_variable_reads, worker_gone_secs, **unchecked):
  """Raises for the first bad option, in the constructor's order."""
  del unchecked  # Flags taken as bool(); sparse_reduction in make().
  _seconds_or_none("stall_log_secs", stall_log_secs)
  _seconds_or_none("stall_timeout_secs", stall_timeout_secs)
  _log_steps(statistics_log_steps)
  if worker_index is not None or one_gradient_per_worker:
    _checks.one_gradient_per_worker(
        bool(one_gradient_per_worker), worker_index, replicas_to_aggregate=r,
        total_num_replicas=t, prompt_stop=prompt_stop)
  if (min_replicas_to_aggregate is not None
      or aggregation_deadline_secs is not None):
    _checks.deadline(min_replicas_to_aggregate, aggregation_deadline_secs,
                     replicas_to_aggregate=r, prompt_stop=prompt_stop)
  _checks.averages(variable_averages, variables_to_average)
  _timeline.directory_from(timeline_dir)
  _rewired_reads.enabled_from(pack_variable_reads)
  _data_end.check(data_end, prompt_stop=prompt_stop)
  _gone.secs_from(worker_gone_secs, data_end=data_end)
  _transfer.dtype_from(transfer_dtype)
  _prefetch.check_with_packing(prefetch_variable_reads, pack_variable_reads)


def make(r, t, **extras):
  """The ``Options`` of checked replica counts ``r``, ``t`` and ``extras``.

  ``extras`` are the constructor's other keywords (``check_extras`` first).
  """
  reduction = _checks.sparse_reduction(extras["sparse_reduction"])
  flags = ("prompt_stop", "statistics", "fuse_dense_gradients",
           "pack_gradient_transfers", "averages_before_tokens",
           "one_gradient_per_worker")
  values = dict(extras)
  values.update({k: bool(extras[k]) for k in flags})
  values.update(
      sparse_reduction=reduction,
      # A sum or a replica mean over rows is only right with unique rows.
      combine_sparse_duplicates=(bool(extras["combine_sparse_duplicates"])
                                 or reduction != _checks.ROW_MEAN),
      statistics_log_steps=extras["statistics_log_steps"] or 0,
      timeline_dir=_timeline.directory_from(extras["timeline_dir"]),
      # Prefetched reads are packed reads made after the token.
      pack_variable_reads=(
          _rewired_reads.enabled_from(extras["pack_variable_reads"])
          or _prefetch.enabled_from(extras["prefetch_variable_reads"])),
      prefetch_variable_reads=_prefetch.enabled_from(
          extras["prefetch_variable_reads"]),
      transfer_dtype=_transfer.dtype_from(extras["transfer_dtype"]),
      worker_gone_secs=_gone.secs_from(extras["worker_gone_secs"],
                                       data_end=extras["data_end"]))
  return Options(replicas_to_aggregate=r, total_num_replicas=t, **values)

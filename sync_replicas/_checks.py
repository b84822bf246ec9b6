"""Argument checks shared by the accumulator-based and the legacy optimizer.

Each raises before any op exists, saying what was expected, what arrived and
how to fix it.
"""

import numbers
import os

import tensorflow as tf

from sync_replicas import _compat


#: Stock's sparse reduction: each row averaged over the gradients holding it.
ROW_MEAN = "row_mean"
SPARSE_REDUCTIONS = (ROW_MEAN, "replica_mean", "sum")


def sparse_reduction(value):
  if value not in SPARSE_REDUCTIONS:
    raise ValueError(
        "sparse_reduction must be one of %s, got %r. Use \"row_mean\" for "
        "stock's per-row mean, \"replica_mean\" to divide each row's sum by "
        "the number of aggregated gradients (as a dense gradient is "
        "averaged), or \"sum\"." % (", ".join(SPARSE_REDUCTIONS), value))
  return value


def one_gradient_per_worker(enabled, worker_index, *, replicas_to_aggregate,
                            total_num_replicas, prompt_stop):
  """Checks the options of the per-worker token queues."""
  if not enabled:
    raise ValueError(
        "worker_index=%r was given without one_gradient_per_worker=True; it "
        "only picks the worker's own token queue. Pass "
        "one_gradient_per_worker=True, or drop worker_index." % (worker_index,))
  if (isinstance(worker_index, bool)
      or not isinstance(worker_index, numbers.Integral)
      or not 0 <= worker_index < total_num_replicas):
    raise ValueError(
        "one_gradient_per_worker=True needs worker_index, this worker's task "
        "index in [0, total_num_replicas=%d), got %r. Pass the task index "
        "the worker's server was started with." % (total_num_replicas,
                                                   worker_index))
  if total_num_replicas < replicas_to_aggregate:
    raise ValueError(
        "one_gradient_per_worker=True cannot reach replicas_to_aggregate=%d "
        "with total_num_replicas=%d workers: each worker gives at most one "
        "gradient per update. Pass total_num_replicas >= "
        "replicas_to_aggregate, or drop one_gradient_per_worker for "
        "multi-batch accumulation." % (replicas_to_aggregate,
                                       total_num_replicas))
  if not prompt_stop:
    raise ValueError(
        "one_gradient_per_worker=True needs prompt_stop=True: stock's queue "
        "runner closes only sync_token_q when it stops, and workers would "
        "stay blocked on their own token queues.")


def int64_global_step(global_step):
  """Raises unless ``one_gradient_per_worker`` gets an int64 global step.

  A restarted chief rolls an int32 step back to its checkpoint, below the
  steps workers already pushed at; they would skip every token until the
  step caught up, and with no backups nobody would push. int64 steps carry
  the restart generation (_restart), which keeps new tokens above every old
  step.
  """
  if global_step.dtype.base_dtype != tf.int64:
    raise ValueError(
        "one_gradient_per_worker=True needs an int64 global step, got %s "
        "of dtype %s. Use tf.compat.v1.train.get_or_create_global_step(), "
        "which makes an int64 one." % (global_step.name,
                                       global_step.dtype.base_dtype.name))


def deadline(min_replicas, secs, *, replicas_to_aggregate, prompt_stop):
  """Checks min_replicas_to_aggregate and aggregation_deadline_secs."""
  if (min_replicas is None) != (secs is None):
    raise ValueError(
        "min_replicas_to_aggregate and aggregation_deadline_secs go "
        "together: got %r and %r. Pass both (e.g. 2 and 5.0: after 5 s "
        "apply whatever arrived if every variable has at least 2 gradients) "
        "or neither." % (min_replicas, secs))
  if (isinstance(min_replicas, bool)
      or not isinstance(min_replicas, numbers.Integral)
      or not 1 <= min_replicas <= replicas_to_aggregate):
    raise ValueError(
        "min_replicas_to_aggregate must be an int in [1, "
        "replicas_to_aggregate=%d], got %r." % (replicas_to_aggregate,
                                                min_replicas))
  if (isinstance(secs, bool) or not isinstance(secs, numbers.Real)
      or not secs > 0):
    raise ValueError(
        "aggregation_deadline_secs must be a number of seconds > 0, got %r."
        % (secs,))
  if not prompt_stop:
    raise ValueError(
        "aggregation_deadline_secs needs prompt_stop=True: with "
        "prompt_stop=False the chief runs stock's queue runner, which blocks "
        "in take_grad until replicas_to_aggregate gradients arrived and "
        "never applies the deadline.")


def averages(variable_averages, variables_to_average):
  """Raises unless both or neither of the averaging arguments are given."""
  if (variable_averages is None) != (variables_to_average is None):
    raise ValueError(
        "variable_averages and variables_to_average go together: got "
        "variable_averages=%r and variables_to_average=%r. Pass both (an "
        "ExponentialMovingAverage and the list of variables it averages) or "
        "neither." % (variable_averages, variables_to_average))


def positive_int(name, value, fix):
  # bool is an int subclass; True replicas is always a typo.
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
      or value < 1):
    raise ValueError(
        "%s must be a positive int, got %r (%s). %s"
        % (name, value, type(value).__name__, fix))
  return int(value)


def v1_optimizer(opt):
  """Raises unless ``opt`` is a ``tf.compat.v1.train.Optimizer``.

  A Keras optimizer gets advice for its kind: Keras 3 ones cannot work in
  graph mode at all, Keras 2's non-legacy ones silently update nothing there,
  and Keras 2 legacy ones reach this check only through a class that does not
  adapt them (``SyncReplicasOptimizer`` does, in ``_keras``).
  """
  if isinstance(opt, tf.compat.v1.train.Optimizer):
    return
  kind = "%s.%s" % (type(opt).__module__, type(opt).__qualname__)
  keras = _compat.keras_of(opt)
  if keras is None:
    raise TypeError(
        "opt must be a tf.compat.v1.train.Optimizer, got %r (%s). Pass e.g. "
        "tf.compat.v1.train.GradientDescentOptimizer(learning_rate)."
        % (opt, kind))
  package, major = keras
  first = ("opt must be a tf.compat.v1.train.Optimizer, got the Keras "
           "optimizer %s (%s %s)." % (kind, package, major or "?"))
  v1_advice = ("tf.compat.v1.train.GradientDescentOptimizer or "
               "tf.compat.v1.train.AdamOptimizer")
  legacy = _compat.keras_legacy_optimizer_types()
  if legacy and isinstance(opt, legacy):
    raise TypeError(
        "%s This class does not adapt Keras 2 legacy optimizers "
        "(sync_replicas.SyncReplicasOptimizer does); pass a v1 optimizer "
        "such as %s." % (first, v1_advice))
  if major is not None and major >= 3:
    raise TypeError(
        "%s A Keras 3 optimizer cannot work in a graph-mode session: its "
        "variables are Keras variables made outside the tf.compat.v1 graph, "
        "and its apply_gradients returns a variable, not a graph op, so a "
        "Session can neither initialize its state nor run its update. Use a "
        "v1 optimizer such as %s, or a Keras 2 legacy optimizer: pip install "
        "tf_keras (the same minor version as TensorFlow) and pass e.g. "
        "tf_keras.optimizers.legacy.SGD or tf_keras.optimizers.legacy.Adam."
        % (first, v1_advice))
  legacy_twin = ("tf_keras" if package == "tf_keras" else "tf.keras") + (
      ".optimizers.legacy." + type(opt).__name__)
  raise TypeError(
      "%s Keras 2's non-legacy optimizers keep their state outside the "
      "graph: in a graph-mode session their update runs but changes nothing. "
      "Use the legacy twin %s, or a v1 optimizer such as %s."
      % (first, legacy_twin, v1_advice))


def apply_arguments(grads_and_vars, global_step):
  """Checks apply_gradients' arguments, as stock words them, before any op.

  Args:
    grads_and_vars: A tuple of (gradient, variable) pairs.
    global_step: What was passed as the global step.

  Raises:
    ValueError: If grads_and_vars is empty, holds something other than
      pairs, an unknown gradient type or only None gradients, or if the
      global step is missing or not an int32/int64 variable or tensor.
  """
  if not grads_and_vars:
    raise ValueError("Must supply at least one variable")
  if global_step is None:
    raise ValueError(
        "Global step is required to check staleness. Pass global_step="
        "tf.compat.v1.train.get_or_create_global_step().")
  dtype = getattr(global_step, "dtype", None)
  if dtype is None or not hasattr(global_step, "device"):
    raise ValueError(
        "Global step is required to check staleness: expected an int32 or "
        "int64 variable, got %r (%s). Use "
        "tf.compat.v1.train.get_or_create_global_step()."
        % (global_step, type(global_step).__name__))
  if dtype.base_dtype not in _compat.GLOBAL_STEP_DTYPES:
    raise ValueError(
        "Global step must be an int32 or int64 variable to check staleness, "
        "got %s of dtype %s. Use "
        "tf.compat.v1.train.get_or_create_global_step()."
        % (global_step.name, dtype.base_dtype.name))
  for pair in grads_and_vars:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
      raise ValueError(
          "grads_and_vars must hold (gradient, variable) pairs as returned "
          "by compute_gradients(), got %r." % (pair,))
    grad, var = pair
    if grad is None:
      continue
    if not (_compat.is_dense_gradient(grad)
            or _compat.is_sparse_gradient(grad)):
      raise ValueError(
          "Unknown grad type! Expected a tf.Tensor, a tf.IndexedSlices or "
          "None for variable %s, got %s. Convert it with "
          "tf.convert_to_tensor() first."
          % (getattr(var, "name", var), type(grad).__name__))
  if all(grad is None for grad, _ in grads_and_vars):
    # The wrapped optimizer would say this only after half the graph
    # existed; say it with its words before anything is built.
    raise ValueError(
        "No gradients provided for any variable: %s."
        % ([getattr(v, "name", v) for _, v in grads_and_vars],))


def init_tokens(num_tokens, *, replicas_to_aggregate, total_num_replicas):
  """Validates an initial token count; returns the count to enqueue.

  Args:
    num_tokens: -1 for stock's default (``replicas_to_aggregate``), or a
      count of at least ``replicas_to_aggregate - total_num_replicas``.
    replicas_to_aggregate: Gradients each update averages.
    total_num_replicas: Workers in the job.

  Returns:
    The number of tokens to enqueue.

  Raises:
    ValueError: If num_tokens is not an int or is too small (stock's words
      first).
  """
  if isinstance(num_tokens, bool) or not isinstance(num_tokens,
                                                    numbers.Integral):
    raise ValueError(
        "num_tokens must be an int, got %r (%s). Pass -1 for the default "
        "(replicas_to_aggregate=%d tokens)."
        % (num_tokens, type(num_tokens).__name__, replicas_to_aggregate))
  if num_tokens == -1:
    # Stock's default: one step's worth, so any worker may supply all of it.
    return replicas_to_aggregate
  # Fewer replicas than gradients per update: the first update needs the
  # difference in extra tokens.
  needed = replicas_to_aggregate - total_num_replicas
  if num_tokens < needed or num_tokens < -1:
    raise ValueError(
        "Too few tokens to finish the first step: %d (given) vs %d (needed)"
        ". With replicas_to_aggregate=%d and total_num_replicas=%d the "
        "workers must deliver %d more gradients than there are workers; "
        "pass num_tokens >= %d, or -1 for the default (%d)."
        % (num_tokens, needed, replicas_to_aggregate, total_num_replicas,
           max(needed, 0), max(needed, 0), replicas_to_aggregate))
  return int(num_tokens)


_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def flag_from(knob, env, value, environ=None):
  """``value`` (the keyword ``knob``) as a bool; None reads ``env`` (unset:
  False).

  Raises:
    ValueError: the argument is not a bool or None, or the environment
      variable holds neither a yes nor a no.
  """
  if value is None:
    text = (os.environ if environ is None else environ).get(env, "")
    if text.strip().lower() in _ON:
      return True
    if text.strip().lower() in _OFF:
      return False
    raise ValueError(
        "%s must be 1 or 0 (or true/false, yes/no, on/off), got %r. Set it "
        "to 1 to turn %s on for a script run unchanged, or unset it."
        % (env, text, knob))
  if not isinstance(value, bool):
    raise ValueError(
        "%s must be True, False or None (the environment's %s), got %r."
        % (knob, env, value))
  return value

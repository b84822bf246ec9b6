"""The one place that knows about TensorFlow versions and graph-mode details.

Everything here uses public ``tf.compat.v1`` API only; the module exists so that
version differences (2.15 vs 2.21) have a single home instead of leaking into
the optimizer, the hook and the accumulators. That includes which Keras an
optimizer comes from: TensorFlow 2.15's ``tf.keras`` is Keras 2, 2.16+'s is
Keras 3, and ``tf_keras`` keeps Keras 2 for both.
"""

import contextlib
import sys

import tensorflow as tf

#: The dtypes a global step may have; the accumulators compare it with the
#: worker's local step, which only works for integers.
GLOBAL_STEP_DTYPES = (tf.int32, tf.int64)


def is_dense_gradient(grad):
  """True for a graph tensor (``tf.Tensor`` covers TF 2.15's and 2.21's)."""
  return isinstance(grad, tf.Tensor)


def is_sparse_gradient(grad):
  return isinstance(grad, tf.IndexedSlices)


def gradient_tensors(grads_and_vars):
  """The tensors that carry the gradients (an IndexedSlices' values and
  indices), the Nones left out: where walks back from the gradients start."""
  tensors = []
  for grad, _ in grads_and_vars:
    if grad is None:
      continue
    if isinstance(grad, tf.IndexedSlices):
      tensors.extend([grad.values, grad.indices])
    else:
      tensors.append(grad)
  return tensors


def queue_runner_closer(queue_runner):
  """QueueRunner's closer thread body: waits for a stop, runs the cancel op.

  Private in every TensorFlow from 1.0 to 2.21 (``_close_on_stop(sess,
  cancel_op, coord)``); the in-process sync loop reuses it unchanged.
  """
  return queue_runner._close_on_stop  # pylint: disable=protected-access


def colocate_with_local_anchor(anchor):
  """Context that keeps a variable on the worker task holding ``anchor``.

  Stock does this through the default distribution strategy; the public
  spelling is ``tf.distribute.get_strategy().extended.colocate_vars_with``.
  """
  return tf.distribute.get_strategy().extended.colocate_vars_with(anchor)


def check_ready(ready_op, session, what):
  """Runs a ``report_uninitialized_variables`` op and reads its answer.

  The same contract as SessionManager's private readiness check, rebuilt on
  public API: ``(True, None)`` when nothing is uninitialized, otherwise
  ``(False, message)`` naming the variables.

  Args:
    ready_op: A string tensor listing uninitialized variables, or None.
    session: The session to run it in.
    what: Text put in front of an unexpected error's log line.

  Returns:
    A ``(ready, message)`` pair.
  """
  if ready_op is None:
    return True, None
  try:
    names = session.run(ready_op)
  except tf.errors.FailedPreconditionError as e:
    # A variable the op itself reads may be missing; that means "not ready".
    if "uninitialized" not in str(e):
      raise
    return False, str(e)
  if names is None or names.size == 0:
    return True, None
  listed = ", ".join(n.decode("utf-8") for n in names.ravel())
  return False, "%s Variables not initialized: %s" % (what, listed)


def session_config(session):
  """The ConfigProto a session was created with, or None.

  A session keeps no public handle on its config; the chief's runner needs it
  to open its own session with the same device filters and cluster settings.
  """
  return getattr(session, "_config", None)


def operation_timeout_ms(session):
  """The ``operation_timeout_in_ms`` a session was created with; 0 for
  none (no config, or the field unset)."""
  config = session_config(session)
  return config.operation_timeout_in_ms if config is not None else 0


def request_stop(coord, exc_info):
  """``coord.request_stop(exc_info)`` from a thread beside the training
  thread; whether ``coord`` now holds that error, which its ``join`` (in
  MonitoredSession's close) raises in the training thread.

  A coordinator that has stopped records no error of a later request, and
  one already joined raises it in the calling thread instead (TensorFlow's
  ``Coordinator.request_stop``: nobody is left to raise it to). The join
  waits at most ``stop_grace_period_secs`` for the threads registered with
  it, so a watch whose bounded look outlasts that grace, after the run it
  watched ended by itself, would die there with an unhandled exception.
  Either way the error cannot reach the training thread any more: False,
  and the caller's thread ends cleanly.
  """
  if coord.should_stop():
    return False
  error = exc_info[1]
  try:
    coord.request_stop(exc_info)
  except Exception as e:  # pylint: disable=broad-except
    if e is not error:
      raise
    return False  # Joined between the check and the request.
  try:
    coord.raise_requested_exception()
  except Exception as e:  # pylint: disable=broad-except
    return e is error
  return False


def quiet_deprecations():
  """A context in which TensorFlow prints no deprecation warning.

  Ours builds the chief's runner on ``QueueRunner``, whose constructor warns
  "QueueRunner.__init__ ... is deprecated" in every process: noise from our
  code path, not the user's (issue 16). TensorFlow's switch for that lives in
  a private module; without it, the warning is printed as before.
  """
  try:
    from tensorflow.python.util import deprecation  # pylint: disable=g-import-not-at-top
    return deprecation.silence()
  except (ImportError, AttributeError):
    return contextlib.nullcontext()


def session_closed(session):
  """True once ``session.close()`` ran.

  A session says so only through a private flag; the chief's runner needs it
  to follow a session that is closed without a stop request.
  """
  return bool(getattr(session, "_closed", False))


#: The packages a Keras optimizer may come from: Keras itself (2 on TF 2.15,
#: 3 from 2.16 on, as ``tf.keras``) and tf_keras (Keras 2 for any TF).
_KERAS_PACKAGES = ("tf_keras", "keras")


def keras_of(opt):
  """Which Keras defines ``opt``'s class: ``(package, major version)``.

  Read from the modules already imported, never by importing Keras (slow,
  and noisy on 2.15): an object of a Keras that is not loaded cannot exist.

  Args:
    opt: Any object.

  Returns:
    ``("keras" or "tf_keras", major)`` with ``major`` an int, or None when it
    cannot be read; None for an object that no Keras defines.
  """
  package = type(opt).__module__.split(".")[0]
  if package not in _KERAS_PACKAGES:
    return None
  version = getattr(sys.modules.get(package), "__version__", "")
  major = version.split(".")[0]
  return package, int(major) if major.isdigit() else None


def keras_legacy_optimizer_types():
  """The Keras 2 legacy ``OptimizerV2`` classes of the loaded Keras packages.

  ``tf_keras.optimizers.legacy.Optimizer`` and, on TensorFlow 2.15,
  ``tf.keras.optimizers.legacy.Optimizer``. Keras 3 keeps only a stub of that
  name, which is left out.
  """
  found = []
  for package in _KERAS_PACKAGES:
    module = sys.modules.get(package)
    version = str(getattr(module, "__version__", ""))
    if module is None or not version.startswith("2."):
      continue
    try:
      cls = module.optimizers.legacy.Optimizer
    except (AttributeError, ImportError):
      continue
    if isinstance(cls, type):
      found.append(cls)
  return tuple(found)


def is_ref_variable(var):
  """True for a TF1 reference variable (``use_resource=False``).

  Its dtype is the ``_ref`` twin of its value's dtype; a resource variable's
  is the value's dtype itself.
  """
  dtype = getattr(var, "dtype", None)
  return dtype is not None and dtype != dtype.base_dtype


#: Where TensorFlow defines stock's SyncReplicasOptimizer, and the generated
#: API module behind ``tf.compat.v1.train`` (``tf.train`` under ``import
#: tensorflow.compat.v1 as tf``): the two homes the opt-in patch
#: (``sync_replicas.patch``) must find holding stock's class, or it refuses
#: this TensorFlow's layout. The same from 2.15 to 2.21.
STOCK_SYNC_REPLICAS_MODULE = (
    "tensorflow.python.training.sync_replicas_optimizer")
STOCK_SYNC_REPLICAS_API_MODULE = "tensorflow._api.v2.compat.v1.train"


def update_input(op, index, tensor):
  """Makes ``op`` take ``tensor`` as its input ``index``.

  TensorFlow has no public way to edit an op's inputs in place; the private
  ``Operation._update_input`` (the C API's UpdateEdge) has done it from 1.x
  to 2.21 unchanged. ``pack_variable_reads`` needs it: the model, built
  by the user's code, exists before the optimizer sees it.
  """
  op._update_input(index, tensor)  # pylint: disable=protected-access

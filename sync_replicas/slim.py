"""tf-slim's training loop with our optimizer: ``slim_train``.

Owns the adapter between ``tf_slim.learning.train`` (the ``tf-slim``
package, used by many TF1 model zoos) and our ``SyncReplicasOptimizer``.

``tf_slim.learning.train(..., sync_optimizer=opt)`` checks
``isinstance(opt, sync_replicas_optimizer.SyncReplicasOptimizer)`` against
TensorFlow's class, through its module global ``sync_replicas_optimizer``,
and rejects ours. ``slim_train`` takes the same arguments and runs
tf-slim's own ``train`` code object, unchanged, with a private copy of the
``tf_slim.learning`` globals in which ``sync_replicas_optimizer`` is a view
of TensorFlow's module whose ``SyncReplicasOptimizer`` is the pair
(TensorFlow's class, ours). Every other line of ``train`` runs as
written, and everything it calls is tf-slim's and TensorFlow's own.

Why this and not the alternatives (docs/tf_slim.md has the long form):

* Nothing shared is modified, at import or during a call: the
  ``tf_slim.learning`` module, its ``train`` and TensorFlow's module are
  untouched, so no lock is needed, concurrent calls (ours or anyone's
  direct ``tf_slim.learning.train``) cannot see each other, and importing
  ``sync_replicas`` has no effect on other libraries. Temporarily swapping
  the module global inside ``tf_slim.learning`` (with a lock and a
  reference count) would work too, but for the whole length of a training
  run every other user of tf-slim in the process would see the swap.
* Subclassing TensorFlow's class, or answering its ``isinstance`` with a
  ``__class__`` property, would make our optimizer claim to be stock's to
  every check in every library, not only this one; the package never
  imports or subclasses stock's class.
* A copy of tf-slim's ``train`` in this package would drift from the
  release users pin.

Stock optimizers are still accepted (TensorFlow's class is in the pair), so
a script can switch to ``slim_train`` before it switches optimizers. The
globals are copied at each call, so a name patched in ``tf_slim.learning``
before the call is seen by it.
"""

import types
import typing

from sync_replicas.optimizer import SyncReplicasOptimizer

if typing.TYPE_CHECKING:  # Only the annotations name it.
  import tensorflow as tf

#: The tf-slim release this adapter is tested with (setup.cfg's test extra).
TESTED_TF_SLIM = "1.1.0"

# The module global tf_slim.learning.train reads TensorFlow's class from.
_MODULE_GLOBAL = "sync_replicas_optimizer"


def _tf_slim_learning():
  """Imports ``tf_slim.learning`` on first use; tf-slim is optional."""
  try:
    from tf_slim import learning  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "sync_replicas.slim_train runs tf_slim.learning.train, but tf-slim "
        "could not be imported (%s). Install it with `pip install "
        "tf-slim==%s` (the release this adapter is tested with)."
        % (e, TESTED_TF_SLIM)) from e
  return learning


class _AcceptingOurs:
  """TensorFlow's ``sync_replicas_optimizer`` module, as the copy sees it.

  ``SyncReplicasOptimizer`` is the pair (TensorFlow's class, ours), which
  ``isinstance`` accepts in place of a class; every other attribute is the
  module's own.
  """

  def __init__(self, module):
    self._module = module
    self.SyncReplicasOptimizer = (  # pylint: disable=invalid-name
        module.SyncReplicasOptimizer, SyncReplicasOptimizer)

  def __getattr__(self, name):
    return getattr(self._module, name)


def _train_accepting_ours(learning):
  """``learning.train``'s code, run with globals that accept our class."""
  train = learning.train
  module = getattr(learning, _MODULE_GLOBAL, None)
  if (not isinstance(train, types.FunctionType) or module is None
      or _MODULE_GLOBAL not in train.__code__.co_names):
    raise RuntimeError(
        "sync_replicas.slim_train expects tf_slim.learning.train to be a "
        "plain function that reads the module global %r (tf-slim %s), got "
        "train=%r and %s=%r. Install tf-slim==%s, or report the tf-slim "
        "version you use."
        % (_MODULE_GLOBAL, TESTED_TF_SLIM, train, _MODULE_GLOBAL, module,
           TESTED_TF_SLIM))
  namespace = dict(train.__globals__)
  namespace[_MODULE_GLOBAL] = _AcceptingOurs(module)
  clone = types.FunctionType(train.__code__, namespace, train.__name__,
                             train.__defaults__, train.__closure__)
  clone.__kwdefaults__ = train.__kwdefaults__
  return clone


def slim_train(train_op: "tf.Tensor | tf.Operation", logdir: "str | None",
               *args: typing.Any, **kwargs: typing.Any) -> typing.Any:
  """``tf_slim.learning.train``, accepting our optimizer as ``sync_optimizer``.

  Takes exactly ``tf_slim.learning.train``'s arguments, positional or by
  keyword, and runs tf-slim's own training loop: its Supervisor with
  ``chief_init_op`` (chief) or ``local_step_init_op`` (others) as the local
  init op and ``ready_for_local_init_op``, the chief queue runner and the
  init tokens started by the chief, and ``sv.stop()`` at the end. With
  our optimizer (``prompt_stop=True``, the default) the chief's queue
  runner ends when training stops, so that ``stop()`` returns at once; with
  stock's, it waits out the Supervisor's ``stop_grace_secs`` (120 s, which
  tf-slim does not expose) and raises, as it does when called directly.

  Args:
    train_op: As ``tf_slim.learning.train``'s.
    logdir: As ``tf_slim.learning.train``'s.
    *args: ``tf_slim.learning.train``'s further positional arguments.
    **kwargs: Its keyword arguments; ``sync_optimizer`` may be our
      ``SyncReplicasOptimizer``, TensorFlow's, or a list of them.

  Returns:
    What ``tf_slim.learning.train`` returns: the last loss value.

  Raises:
    ImportError: tf-slim is not installed.
    RuntimeError: ``tf_slim.learning.train`` is not the function this
      adapter knows (another tf-slim release).
    ValueError: As ``tf_slim.learning.train`` raises, e.g. for a
      ``sync_optimizer`` that is neither our class nor TensorFlow's.
  """
  train = _train_accepting_ours(_tf_slim_learning())
  return train(train_op, logdir, *args, **kwargs)

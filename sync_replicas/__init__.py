"""Synchronous parameter-server training for TensorFlow's graph mode.

A faithful, importable replacement for
``tf.compat.v1.train.SyncReplicasOptimizer`` and its session hook.

The public names load on first use, not at ``import sync_replicas``: the
patch runner (``python -m sync_replicas.patch SCRIPT``) imports this package
before the script runs, and a script that sets TensorFlow's environment
(``TF_CPP_MIN_LOG_LEVEL``, ...) before its own ``import tensorflow`` must
find TensorFlow not yet imported, as under ``python SCRIPT``.
"""

import importlib
import typing

if typing.TYPE_CHECKING:  # For readers and type checkers: the same names.
  from sync_replicas.cluster import LocalCluster
  from sync_replicas.errors import NotBuiltError
  from sync_replicas.errors import SyncStallError
  from sync_replicas.errors import SyncTimeoutError
  from sync_replicas.errors import is_recoverable_error
  from sync_replicas.hook import SyncReplicasOptimizerHook
  from sync_replicas.legacy import SyncReplicasOptimizerV2
  from sync_replicas.optimizer import SyncReplicasOptimizer
  from sync_replicas.ps_server import ps_server_config
  from sync_replicas.ps_wait import wait_for_job_end
  from sync_replicas.reads import read_packed
  from sync_replicas.ready import wait_for_chief_init
  from sync_replicas.slim import slim_train

__version__ = "0.1.0"

#: Each public name and the module that defines it.
_HOMES = {
    "LocalCluster": "sync_replicas.cluster",
    "NotBuiltError": "sync_replicas.errors",
    "SyncStallError": "sync_replicas.errors",
    "SyncTimeoutError": "sync_replicas.errors",
    "SyncReplicasOptimizer": "sync_replicas.optimizer",
    "SyncReplicasOptimizerHook": "sync_replicas.hook",
    "SyncReplicasOptimizerV2": "sync_replicas.legacy",
    "is_recoverable_error": "sync_replicas.errors",
    "ps_server_config": "sync_replicas.ps_server",
    "read_packed": "sync_replicas.reads",
    "slim_train": "sync_replicas.slim",
    "wait_for_chief_init": "sync_replicas.ready",
    "wait_for_job_end": "sync_replicas.ps_wait",
}

# A literal list, which linters and type checkers read without running the
# module (tests/test_package.py checks it against _HOMES).
__all__ = [
    "LocalCluster",
    "NotBuiltError",
    "SyncReplicasOptimizer",
    "SyncReplicasOptimizerHook",
    "SyncReplicasOptimizerV2",
    "SyncStallError",
    "SyncTimeoutError",
    "__version__",
    "is_recoverable_error",
    "ps_server_config",
    "read_packed",
    "slim_train",
    "wait_for_chief_init",
    "wait_for_job_end",
]


def __getattr__(name):
  home = _HOMES.get(name)
  if home is not None:
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # Later look-ups skip this function.
    return value
  # A submodule read as an attribute (``sync_replicas.cluster.free_ports``)
  # worked when this file imported every module eagerly; it still does.
  if not name.startswith("__"):
    try:
      return importlib.import_module("%s.%s" % (__name__, name))
    except ModuleNotFoundError as e:
      if e.name != "%s.%s" % (__name__, name):
        raise
  raise AttributeError("module 'sync_replicas' has no attribute %r" % name)


def __dir__():
  return sorted(set(globals()) | set(_HOMES))

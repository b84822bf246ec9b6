"""Synchronous parameter-server training for TensorFlow's graph mode.

A faithful, importable replacement for
``tf.compat.v1.train.SyncReplicasOptimizer`` and its session hook.
"""

from sync_replicas.cluster import LocalCluster
from sync_replicas.errors import NotBuiltError
from sync_replicas.errors import SyncStallError
from sync_replicas.errors import is_recoverable_error
from sync_replicas.hook import SyncReplicasOptimizerHook
from sync_replicas.legacy import SyncReplicasOptimizerV2
from sync_replicas.optimizer import SyncReplicasOptimizer
from sync_replicas.reads import read_packed
from sync_replicas.slim import slim_train

__version__ = "0.1.0"

__all__ = [
    "LocalCluster",
    "NotBuiltError",
    "SyncStallError",
    "SyncReplicasOptimizer",
    "SyncReplicasOptimizerHook",
    "SyncReplicasOptimizerV2",
    "__version__",
    "is_recoverable_error",
    "read_packed",
    "slim_train",
]

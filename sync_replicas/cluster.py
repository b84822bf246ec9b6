"""Clusters on this machine: in-process gRPC servers on 127.0.0.1.

Owns picking free loopback ports, the ClusterSpec that names them, and the
``tf.distribute.Server`` objects. Tests, examples and tools share it instead
of each pasting their own.
"""

import tensorflow as tf

from sync_replicas._ports import LOOPBACK
from sync_replicas._ports import free_ports


def loopback_cluster_spec(*, num_workers: int,
                          num_ps: int) -> tf.train.ClusterSpec:
  """A ClusterSpec of ``worker`` and ``ps`` tasks on free loopback ports."""
  if num_workers < 1 or num_ps < 0:
    raise ValueError(
        "A cluster needs num_workers >= 1 and num_ps >= 0, got "
        "num_workers=%r, num_ps=%r." % (num_workers, num_ps))
  ports = free_ports(num_workers + num_ps)
  addresses = ["%s:%d" % (LOOPBACK, p) for p in ports]
  jobs = {"worker": addresses[:num_workers]}
  if num_ps:
    jobs["ps"] = addresses[num_workers:]
  return tf.train.ClusterSpec(jobs)


class LocalCluster:
  """One in-process ``tf.distribute.Server`` per task, all on 127.0.0.1.

  TensorFlow cannot stop an in-process server; a fresh LocalCluster per test
  keeps state (accumulators, queues, variables on the ps) from leaking between
  tests.

  Attributes:
    cluster_spec: The ``tf.train.ClusterSpec``.
    workers: Worker servers, by task index.
    ps: Parameter-server servers, by task index.
  """

  def __init__(self, *, num_workers: int, num_ps: int,
               config: "tf.compat.v1.ConfigProto | None" = None) -> None:
    self.cluster_spec = loopback_cluster_spec(num_workers=num_workers,
                                              num_ps=num_ps)
    self.workers = [
        tf.distribute.Server(self.cluster_spec, job_name="worker",
                             task_index=i, config=config, start=True)
        for i in range(num_workers)]
    self.ps = [
        tf.distribute.Server(self.cluster_spec, job_name="ps", task_index=i,
                             config=config, start=True)
        for i in range(num_ps)]

  @property
  def worker_targets(self) -> "list[str]":
    """Session targets (``grpc://127.0.0.1:port``) of the workers."""
    return [w.target for w in self.workers]

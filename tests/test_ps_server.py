"""ps_server_config: the ConfigProto a ps task's server starts with.

What it sets and keeps, its error on bad input, and that it reaches the ps
servers users start: the examples' (and so every program of examples/ under
sync-replicas-launch and sync-replicas-slurm). What it saves in CPU is
tools/bench's and tools/profile_ps's measurement (docs/benchmarks.md), not
a test's.
"""

import pytest
import tensorflow as tf

from examples import _task
import sync_replicas
from sync_replicas import _ports


def test_ps_server_config_stops_spinning_and_changes_nothing_else():
  config = sync_replicas.ps_server_config()
  assert isinstance(config, tf.compat.v1.ConfigProto)
  bare = tf.compat.v1.ConfigProto()
  assert config != bare
  bare.experimental.disable_thread_spinning = True
  assert config == bare


def test_ps_server_config_keeps_the_callers_settings_and_copies():
  base = tf.compat.v1.ConfigProto(operation_timeout_in_ms=5000,
                                  inter_op_parallelism_threads=4)
  config = sync_replicas.ps_server_config(base)
  assert config.operation_timeout_in_ms == 5000
  assert config.inter_op_parallelism_threads == 4
  assert config.experimental.disable_thread_spinning
  assert not base.experimental.disable_thread_spinning  # Not changed.


@pytest.mark.parametrize("bad", ["experimental { disable_thread_spinning: "
                                 "true }", {"operation_timeout_in_ms": 1},
                                 tf.compat.v1.RunOptions()])
def test_ps_server_config_says_what_it_takes(bad):
  with pytest.raises(TypeError, match=r"must be a tf\.compat\.v1\."
                     r"ConfigProto .*got %s" % type(bad).__name__):
    sync_replicas.ps_server_config(bad)


def _task_of(cluster, job):
  return _task.Task(cluster=cluster, job_name=job, task_index=0,
                    is_chief=job == "worker",
                    replica_index=0 if job == "worker" else None,
                    num_replicas=1)


def test_the_examples_start_their_ps_with_it_and_their_workers_without():
  ps_port, worker_port = _ports.free_ports(2)
  cluster = tf.train.ClusterSpec({"ps": ["127.0.0.1:%d" % ps_port],
                                  "worker": ["127.0.0.1:%d" % worker_port]})
  ps = _task.start_server(_task_of(cluster, "ps"))
  worker = _task.start_server(_task_of(cluster, "worker"))
  assert (ps.server_def.default_session_config
          == sync_replicas.ps_server_config())
  assert (worker.server_def.default_session_config
          == tf.compat.v1.ConfigProto())
  # The ps serves a worker's session: a variable placed on it is read.
  with tf.Graph().as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      v = tf.compat.v1.Variable(3.0)
    with tf.compat.v1.Session(worker.target, config=tf.compat.v1.ConfigProto(
        operation_timeout_in_ms=60_000)) as sess:
      sess.run(v.initializer)
      assert sess.run(v) == 3.0

"""Every op outside our status scope is pinned, for many option combinations.

The graph names stock's scripts and checkpoints see depend on the order in
which ``apply_gradients`` builds (issue 17): this test records, for each
combination in ``CASES``, every op's name, type, device and inputs (data
inputs in order, then control inputs sorted, as ``^name``: TensorFlow keeps
those in a set) outside ``<name>_status/``, one op per line, and compares
the graph built now with the committed golden file
``tests/snapshots/<case>.txt``. A restructuring of the build must leave
every file unchanged.

The golden files are generated, never edited by hand:

    SYNC_REPLICAS_UPDATE_SNAPSHOTS=1 python -m pytest -q tests/test_snapshot.py

Regenerate them only for a change that means to alter the graph, and say so
in the commit.
"""

import difflib
import os
import pathlib

import pytest
import tensorflow as tf

import support
import sync_replicas
import sync_replicas.legacy
from sync_replicas import _packing

SNAPSHOTS = pathlib.Path(__file__).resolve().parent / "snapshots"
UPDATE = os.environ.get("SYNC_REPLICAS_UPDATE_SNAPSHOTS") == "1"

#: case id -> (model keywords, optimizer keywords). The model is built by
#: ``_build``; ``averages`` adds variable_averages over two dense variables.
CASES = {
    "defaults": ({}, {}),
    "defaults_no_devices": (dict(ps_tasks=0), {}),
    "defaults_one_ps": (dict(ps_tasks=1), {}),
    "unpacked": ({}, dict(pack_gradient_transfers=False)),
    "fused": ({}, dict(fuse_dense_gradients=True)),
    "fused_unpacked": ({}, dict(fuse_dense_gradients=True,
                                pack_gradient_transfers=False)),
    "statistics": ({}, dict(statistics=True)),
    "statistics_fused": ({}, dict(statistics=True, fuse_dense_gradients=True)),
    "statistics_unpacked": ({}, dict(statistics=True,
                                     pack_gradient_transfers=False)),
    "one_gradient_per_worker": ({}, dict(one_gradient_per_worker=True,
                                         worker_index=1)),
    "one_gradient_per_worker_statistics": (
        {}, dict(one_gradient_per_worker=True, worker_index=0,
                 statistics=True)),
    "deadline": ({}, dict(min_replicas_to_aggregate=1,
                          aggregation_deadline_secs=5.0)),
    "deadline_statistics": ({}, dict(min_replicas_to_aggregate=1,
                                     aggregation_deadline_secs=5.0,
                                     statistics=True)),
    "averages": (dict(averages=True), {}),
    "averages_before_tokens": (dict(averages=True),
                               dict(averages_before_tokens=True)),
    "averages_before_tokens_statistics_per_worker": (
        dict(averages=True), dict(averages_before_tokens=True,
                                  statistics=True,
                                  one_gradient_per_worker=True,
                                  worker_index=2)),
    "combine_sparse_duplicates": ({}, dict(combine_sparse_duplicates=True)),
    "sparse_replica_mean": ({}, dict(sparse_reduction="replica_mean")),
    "sparse_sum": ({}, dict(sparse_reduction="sum")),
    "sparse_sum_statistics_fused": ({}, dict(sparse_reduction="sum",
                                             statistics=True,
                                             fuse_dense_gradients=True)),
    "dense_only": (dict(sparse=False), {}),
    "named": ({}, dict(name="gen")),
    "named_per_worker_statistics": ({}, dict(name="gen", statistics=True,
                                             one_gradient_per_worker=True,
                                             worker_index=1)),
    "int32_step": (dict(int32_step=True), {}),
    "int32_step_statistics_deadline": (
        dict(int32_step=True), dict(statistics=True,
                                    min_replicas_to_aggregate=2,
                                    aggregation_deadline_secs=1.0)),
    "multi_batch": (dict(replicas=3, total=2), {}),
    "multi_batch_averages_statistics": (
        dict(replicas=3, total=2, averages=True), dict(statistics=True)),
    "backups_prompt_stop_off": (dict(replicas=2, total=4),
                                dict(prompt_stop=False, data_end="stock")),
    "everything": (dict(averages=True), dict(
        statistics=True, fuse_dense_gradients=True,
        averages_before_tokens=True, sparse_reduction="replica_mean",
        one_gradient_per_worker=True, worker_index=1,
        min_replicas_to_aggregate=1, aggregation_deadline_secs=2.0,
        name="all")),
    # sync_replicas.legacy.SyncReplicasOptimizer (TF 0.11's queues).
    "legacy": (dict(legacy=True), {}),
    "legacy_averages_int32": (dict(legacy=True, averages=True,
                                   int32_step=True), {}),
    "legacy_multi_batch_dense": (dict(legacy=True, replicas=3, total=2,
                                      sparse=False), {}),
}


def _build(*, ps_tasks=2, sparse=True, averages=False, int32_step=False,
           replicas=2, total=3, legacy=False, **options):
  """Small, large, unused and sparse variables; returns the graph's ops."""
  g = tf.Graph()
  setter = (tf.compat.v1.train.replica_device_setter(
      ps_tasks=ps_tasks, worker_device="/job:worker/task:1")
            if ps_tasks else None)
  with g.as_default(), tf.compat.v1.device(setter):
    if int32_step:
      global_step = tf.compat.v1.Variable(0, dtype=tf.int32,
                                          trainable=False, name="global_step")
    else:
      global_step = tf.compat.v1.train.get_or_create_global_step()
    small = [tf.compat.v1.get_variable("v%d" % i, [3, 2] if i % 2 else [5])
             for i in range(5)]
    big = tf.compat.v1.get_variable("big",
                                    [_packing.MAX_PACKED_ELEMENTS + 1])
    unused = tf.compat.v1.get_variable("unused", [2])
    loss = tf.add_n([tf.reduce_sum(v * v) for v in small + [big]])
    var_list = small + [big, unused]
    if sparse:
      emb = tf.compat.v1.get_variable("emb", [20, 2])
      loss += tf.reduce_sum(tf.gather(emb, [1, 5, 1]))
      var_list.append(emb)
    if averages:
      options.update(
          variable_averages=tf.train.ExponentialMovingAverage(0.9),
          variables_to_average=small[:2])
    if legacy:
      options.update(replica_id=1)
    opt = (sync_replicas.legacy.SyncReplicasOptimizer if legacy
           else support.OURS)(tf.compat.v1.train.AdamOptimizer(0.1),
                              replicas_to_aggregate=replicas,
                              total_num_replicas=total, **options)
    grads = opt.compute_gradients(loss, var_list=var_list)
    opt.apply_gradients(grads, global_step=global_step)
    opt.get_chief_queue_runner()
    opt.get_init_tokens_op()
    if legacy:
      opt.get_clean_up_op()
  own = opt.get_name() + "_status/"
  described = []
  for op in g.get_operations():
    if op.name.startswith(own):
      continue
    inputs = [t.name for t in op.inputs] + sorted(
        "^" + c.name for c in op.control_inputs)
    described.append("%s %s %s <- %s" % (op.name, op.type,
                                          op.device or "-",
                                          " ".join(inputs)))
  return described


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_outside_our_scope_is_unchanged(case):
  model, options = CASES[case]
  described = _build(**model, **options)
  path = SNAPSHOTS / (case + ".txt")
  if UPDATE:
    SNAPSHOTS.mkdir(exist_ok=True)
    path.write_text("".join(line + "\n" for line in described))
  assert path.exists(), (
      "No snapshot %s. Generate it with SYNC_REPLICAS_UPDATE_SNAPSHOTS=1 "
      "(see this file's docstring)." % path)
  expected = path.read_text().splitlines()
  if expected != described:
    diff = list(difflib.unified_diff(
        expected, described, "snapshot", "built now",
        lineterm="", n=1))
    pytest.fail(
        "The graph outside %s_status/ changed for case %r (%d ops "
        "expected, %d built). Stock-visible names, devices and wiring must "
        "not move; if this change means to alter them, regenerate (see the "
        "module docstring). First differences:\n%s" % (
            options.get("name", "sync_replicas"), case, len(expected),
            len(described), "\n".join(diff[:80])))

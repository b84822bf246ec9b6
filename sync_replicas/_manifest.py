"""The sync manifest: where a job's sync state lives, for outside readers.

Owns the small JSON document (format ``sync_replicas.manifest/1``) that names
the global step, the token queue and every accumulator with the device,
dtype and shape a reader needs to open the same shared resources on the ps,
and the read-only ops built from it in a fresh graph. TensorFlow offers no
public way to list a ps task's resources, so the job writes this file
(``SyncReplicasOptimizer.write_sync_manifest``) and ``sync-replicas-status`` reads it.

The read ops only report: ``num_accumulated`` per accumulator, the token
queue's ``size`` and the global step's value. They never take, dequeue or
assign. Opening a shared accumulator or queue that does not exist yet
creates an empty one with the job's own attributes, which the job then uses
as if it had created it.
"""

import collections
import json
import os

import tensorflow as tf

from sync_replicas import _accumulators
from sync_replicas import _diagnose
from sync_replicas import _process
from sync_replicas import _step_record
from sync_replicas import _tokens

FORMAT = "sync_replicas.manifest/1"
#: File name used when ``write`` is given a directory.
FILE_NAME = "sync_manifest.json"

# global_step, tokens: scalar tensors; num_accumulated: one per accumulator,
# in manifest order; starts: the generations queue's length, or None for a
# manifest that does not name it.
ReadOps = collections.namedtuple(
    "ReadOps", ["global_step", "tokens", "num_accumulated", "starts",
                "done_workers", "addresses"], defaults=[None, None])


def build(*, accumulators, global_step, replicas_to_aggregate,
          total_num_replicas, tokens_per_step,
          token_queue_shared_name=_tokens.TOKEN_QUEUE_NAME,
          worker_token_queue_shared_names=(), local_step=None,
          generations_shared_name=None, done_workers_shared_name=None):
  """A manifest (a JSON-serializable dict).

  Args:
    accumulators: ``_accumulators.AccumulatorOps`` entries.
    global_step: The global step variable.
    replicas_to_aggregate: Gradients each update needs.
    total_num_replicas: Workers in the job.
    tokens_per_step: Tokens each update releases.
    token_queue_shared_name: ``sync_token_q``'s shared name.
    worker_token_queue_shared_names: With ``one_gradient_per_worker``, the
      workers' own token queues (their sizes count as tokens queued).
    local_step: This worker's ``sync_rep_local_step``: a reader finds every
      replica's by its name, on each replica task (``_diagnose``).
    generations_shared_name: The restart generations' queue (its length
      says how many times ``chief_init_op`` ran on the ps).
    done_workers_shared_name: With a ``data_end`` policy, the table of the
      workers whose input ended (``_data_end``); None without one.

  Returns:
    The manifest.
  """
  gs = global_step
  entries = [_entry(entry) for entry in accumulators]
  return {
      "format": FORMAT,
      "replicas_to_aggregate": replicas_to_aggregate,
      "total_num_replicas": total_num_replicas,
      "tokens_per_step": tokens_per_step,
      "global_step": {"name": gs.op.name, "device": gs.device,
                      "dtype": gs.dtype.base_dtype.name,
                      "resource": gs.op.type == "VarHandleOp"},
      "token_queue": {"shared_name": token_queue_shared_name,
                      "device": gs.device,
                      "dtype": gs.dtype.base_dtype.name},
      "worker_token_queues": list(worker_token_queue_shared_names),
      "accumulators": entries,
      # Optional keys (readers of older manifests go without them).
      "local_step": (None if local_step is None
                     else dict(_diagnose.local_step_spec(local_step)._asdict())),
      "generations_queue": generations_shared_name,
      "network_namespace": _network_namespace(),
      "done_workers": done_workers_shared_name,
      # Who wrote it: the status tool tells an ended job by it.
      "writer": _process.identity(),
  }


def _network_namespace():
  """The writer's network namespace (its inode), or None off Linux.

  A job that sync-replicas-launch confined is reachable only inside its
  namespace: with this, the status tool finds the launch to enter (the
  one whose namespace it is) without being told.
  """
  try:
    return os.stat("/proc/self/ns/net").st_ino
  except OSError:
    return None


def _entry(entry):
  """The manifest entry of one accumulator."""
  return {
      "variable": entry.name,
      "shared_name": entry.shared_name,
      "device": entry.device,
      "dtype": entry.accumulator.dtype.name,
      # The shape the accumulator was created with: sparse ones learn the
      # row shape from their first gradient and are created with ().
      "shape": [] if entry.sparse else _shape(entry.shape),
      "sparse": entry.sparse,
      # A reader that creates the accumulator must create the job's kind:
      # TensorFlow does not check, and the job would reduce the reader's way.
      "reduction_type": _accumulators.reduction_type(entry),
      # Lets a reader check that the ps holds the job's variable before it
      # opens the accumulator, which would create one if missing.
      "variable_resource": _is_resource(entry),
  }


def _is_resource(entry):
  """True for a resource variable, False for a ref one, None if unknown."""
  graph = entry.accumulator.accumulator_ref.graph
  try:
    return graph.get_operation_by_name(entry.name).type == "VarHandleOp"
  except KeyError:  # A partitioned variable's parts have other names.
    return None


def _shape(shape):
  return None if shape.rank is None else shape.as_list()


def write(manifest, path):
  """Writes ``manifest`` as JSON to ``path``.

  ``path`` is a directory (e.g. the chief's checkpoint_dir), which gets
  ``FILE_NAME`` and is created if it does not exist yet; or a file: one that
  exists, or a new one whose name ends in ``.json`` (its directory is created
  if need be). A missing path without ``.json`` is a directory: the chief
  writes the manifest before its MonitoredTrainingSession creates the
  checkpoint_dir, and a file there would make that session fail.

  Returns:
    The file written.
  """
  is_file = tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path)
  if not is_file and not path.endswith(".json"):
    tf.io.gfile.makedirs(path)
    path = path.rstrip("/") + "/" + FILE_NAME
  elif not is_file and os.path.dirname(path):
    tf.io.gfile.makedirs(os.path.dirname(path))
  with tf.io.gfile.GFile(path, "w") as f:
    f.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
  return path


def read(path):
  """Reads a manifest (a file, or a directory holding one).

  Raises:
    ValueError: If the file is not a sync manifest.
  """
  if tf.io.gfile.isdir(path):
    path = path.rstrip("/") + "/" + FILE_NAME
  if not tf.io.gfile.exists(path):
    raise ValueError(
        "No sync manifest at %s. The job's chief writes it with "
        "opt.write_sync_manifest(checkpoint_dir); the examples write it to "
        "their --logdir. Pass that file or directory." % path)
  with tf.io.gfile.GFile(path) as f:
    text = f.read()
  try:
    manifest = json.loads(text)
  except ValueError as e:
    raise ValueError(
        "%s is not a sync manifest: expected JSON in format %r, got text "
        "that does not parse (%s), starting %r." % (path, FORMAT, e,
                                                  text[:40])) from None
  found = manifest.get("format") if isinstance(manifest, dict) else None
  if isinstance(found, str) and found.startswith(FORMAT.split("/")[0] + "/"):
    if found != FORMAT:
      raise ValueError(
          "%s is a sync manifest of format %r, but this sync_replicas reads "
          "%r. Read it with the sync-replicas-status of the sync_replicas "
          "version the job runs." % (path, found, FORMAT))
  elif found != FORMAT:
    raise ValueError(
        "%s is not a sync manifest: expected format %r, got %r. Write one "
        "with SyncReplicasOptimizer.write_sync_manifest(path)."
        % (path, FORMAT, found if isinstance(manifest, dict)
           else type(manifest).__name__))
  missing = [key for key in _REQUIRED if key not in manifest]
  if missing:
    raise ValueError(
        "%s is a sync manifest without %s, which every manifest of format %r "
        "has: it was cut short or edited. Write it again with "
        "SyncReplicasOptimizer.write_sync_manifest(path)."
        % (path, ", ".join(missing), FORMAT))
  return manifest


#: What every manifest of this format holds (``build``'s keys before the
#: optional ones).
_REQUIRED = ("replicas_to_aggregate", "total_num_replicas", "tokens_per_step",
             "global_step", "token_queue", "accumulators")


def presence_ops(manifest):
  """Ops that tell whether the ps holds the job's variables; create nothing.

  ``read_ops`` opens the token queue and the accumulators by shared name,
  which creates empty ones where none exist: pointed at another job's ps, it
  would leave resources there. A resource variable can be looked up without
  being created (``VarIsInitializedOp`` on a ``VarHandleOp``), so these ops
  check the global step and every accumulator's variable first. A ref
  variable (TF1 behaviour) cannot be looked up that way and is not checked.

  Returns:
    ``(description, bool tensor)`` pairs, built in the current graph.
  """
  checks = []
  gs = manifest["global_step"]
  wanted = [("global step %r" % gs["name"], gs["name"], gs["device"],
             gs["dtype"], gs["resource"])]
  for entry in manifest["accumulators"]:
    wanted.append(("variable %r (accumulator %r)" % (
        entry["variable"], entry["shared_name"]), entry["variable"],
                   entry["device"], entry["dtype"],
                   entry.get("variable_resource")))
  for description, name, device, dtype, resource in wanted:
    if not resource:
      continue
    with tf.compat.v1.device(device):
      handle = tf.raw_ops.VarHandleOp(dtype=tf.as_dtype(dtype), shape=None,
                                      shared_name=name)
      checks.append(("%s on %s" % (description, device or "the target"),
                     tf.raw_ops.VarIsInitializedOp(resource=handle)))
  return checks


def read_ops(manifest):
  """Builds the read-only ops in the current (fresh) graph.

  The global step is opened first so its op gets the job's exact name, which
  is how a ref variable is found on the ps.
  """
  gs = manifest["global_step"]
  dtype = tf.as_dtype(gs["dtype"])
  with tf.compat.v1.device(gs["device"]):
    if gs["resource"]:
      handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=[],
                                      shared_name=gs["name"], name=gs["name"])
      step = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
    else:
      ref = tf.raw_ops.VariableV2(shape=[], dtype=dtype, shared_name=gs["name"],
                                  name=gs["name"])
      step = tf.identity(ref)
  q = manifest["token_queue"]
  with tf.compat.v1.device(q["device"]):
    # Older manifests have no worker queues.
    names = [q["shared_name"]] + list(manifest.get("worker_token_queues", []))
    tokens = tf.add_n([
        tf.queue.FIFOQueue(-1, tf.as_dtype(q["dtype"]), shapes=(),
                           shared_name=name).size() for name in names])
  counts = []
  for entry in manifest["accumulators"]:
    with tf.compat.v1.device(entry["device"]):
      cls = (tf.compat.v1.SparseConditionalAccumulator if entry["sparse"]
             else tf.compat.v1.ConditionalAccumulator)
      accum = cls(tf.as_dtype(entry["dtype"]), shape=entry["shape"],
                  shared_name=entry["shared_name"],
                  reduction_type=entry.get("reduction_type", "MEAN"))
      counts.append(accum.num_accumulated())
  starts = None
  if manifest.get("generations_queue"):
    with tf.compat.v1.device(q["device"]):
      starts = tf.queue.FIFOQueue(
          -1, tf.int32, shapes=(),
          shared_name=manifest["generations_queue"]).size()
  done = None
  if manifest.get("done_workers"):
    with tf.compat.v1.device(q["device"]):
      # The job's own table (same name and types), read by exporting it.
      table = tf.raw_ops.MutableHashTableV2(
          shared_name=manifest["done_workers"], use_node_name_sharing=False,
          key_dtype=tf.int64, value_dtype=tf.int64)
      # Keys and values: a gone worker's value is _gone.GONE.
      done = tf.raw_ops.LookupTableExportV2(
          table_handle=table, Tkeys=tf.int64, Tvalues=tf.int64)
      # Beside it, the workers' task addresses (_step_record's table).
      addresses = tf.raw_ops.LookupTableExportV2(
          table_handle=tf.raw_ops.MutableHashTableV2(
              shared_name=_step_record.addresses_name(
                  manifest["done_workers"]),
              use_node_name_sharing=False, key_dtype=tf.int64,
              value_dtype=tf.string),
          Tkeys=tf.int64, Tvalues=tf.string)
      return ReadOps(step, tokens, counts, starts, done, addresses)
  return ReadOps(step, tokens, counts, starts, done)


def jobs(manifest):
  """The ``/job:...`` prefixes of every device the read ops use."""
  devices = [manifest["global_step"]["device"],
             manifest["token_queue"]["device"]] + [
                 a["device"] for a in manifest["accumulators"]]
  found = set()
  for d in devices:
    spec = tf.DeviceSpec.from_string(d or "")
    if spec.job:
      found.add("/job:%s" % spec.job)
  return sorted(found)

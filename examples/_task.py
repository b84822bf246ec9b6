"""Which task this process is, and the plumbing every example shares.

Owns reading the cluster and this process's place in it from TF_CONFIG (as
``sync-replicas-launch``, Kubernetes TFJob and Estimator set it) or, when
TF_CONFIG is unset, from the TF1-style flags ``--job_name/--task_index/--ps_hosts/
--worker_hosts`` of ``mnist_replica.py``; starting this task's gRPC server; a
ps task's serve-forever loop; and a non-chief's bounded wait for the chief.
None of it is specific to sync_replicas: it is what any between-graph program
needs.

Replicas (the tasks that train) are the ``chief`` task, if the cluster has a
``chief`` job, followed by the ``worker`` tasks. Without a ``chief`` job,
worker 0 is the chief, as in TF1.
"""

import argparse
import collections
import json
import logging
import os
import sys

import tensorflow as tf

import sync_replicas

_LOG = logging.getLogger("examples.task")

# Not sync_replicas._ports.LOOPBACK: examples use only the public API.
LOOPBACK = "127.0.0.1"
_DEFAULT_PS = LOOPBACK + ":2222"
_DEFAULT_WORKERS = ",".join("%s:%d" % (LOOPBACK, p) for p in (2223, 2224, 2225))

Task = collections.namedtuple("Task", [
    "cluster",        # tf.train.ClusterSpec
    "job_name",       # "ps", "chief" or "worker"
    "task_index",     # index within job_name
    "is_chief",       # the replica that initializes, checkpoints, evaluates
    "replica_index",  # 0 for the chief, then 1, 2, ... (for data shards)
    "num_replicas",   # chief + workers
])
Task.__doc__ = "This process's place in the cluster."


def name(task):
  """How the task names itself in its lines: as its cluster does,
  ``chief0``, ``worker1``, ``ps0``.

  The same job and index as its TF_CONFIG (or its flags) and its device
  (``/job:worker/task:1``), in the form of the launcher's labels
  (``[worker1]``), the package's own lines, the status tool and the
  timeline: one numbering everywhere. Without a ``chief`` job, worker 0 is
  the chief.
  """
  return "%s%d" % (task.job_name, task.task_index)


def setup_logging(level=logging.INFO, *, name="examples", fmt="%(message)s"):
  """Sends the ``name`` loggers' lines (the examples' own by default,
  unadorned) to stderr.

  Only those loggers are configured: a root handler would also print every
  TensorFlow INFO line, twice.
  """
  logger = logging.getLogger(name)
  if not logger.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
  logger.setLevel(level)
  logger.propagate = False
  tf_logger = logging.getLogger("tensorflow")
  if not any(isinstance(f, _TensorFlowsOwnDeprecations)
             for f in tf_logger.filters):
    tf_logger.addFilter(_TensorFlowsOwnDeprecations())


class _TensorFlowsOwnDeprecations(logging.Filter):
  """Drops TensorFlow's notes that its own code calls a deprecated function
  of its own (a resume logged "get_checkpoint_mtimes (from
  tensorflow.python.checkpoint...) is deprecated", from
  MonitoredTrainingSession's restore): nothing a reader of the examples can
  act on. Every other TensorFlow line passes."""

  def filter(self, record):
    message = record.getMessage()
    return not ("is deprecated" in message and "(from tensorflow." in message
                and "/tensorflow/" in message.split(":", 1)[0])


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows each default once: not after a help text that says it in words,
  and not at all for an option without a value (None, False)."""

  def _get_help_string(self, action):
    text = action.help or ""
    if ("default" in text or action.default is None
        or action.default is False):
      return text
    return super()._get_help_string(action)


def command(name):
  """How to run the installed command ``name`` from here, as printed.

  The one beside this Python (a venv's bin, on PATH only once the venv is
  activated), relative when it is under the working directory; else the
  bare name.
  """
  path = os.path.join(os.path.dirname(sys.executable), name)
  if not os.path.exists(path):
    return name
  relative = os.path.relpath(path)
  return path if relative.startswith("..") else relative


def add_cluster_flags(parser):
  """Adds the TF1 cluster flags and ``--backups`` to an argparse parser."""
  group = parser.add_argument_group(
      "cluster", "used only when TF_CONFIG is unset")
  group.add_argument("--job_name", choices=("ps", "worker"),
                     help="this task's job")
  group.add_argument("--task_index", type=int, default=None,
                     help="this task's index within its job")
  group.add_argument("--ps_hosts", default=None,
                     help="comma-separated host:port list (default %s)"
                     % _DEFAULT_PS)
  group.add_argument("--worker_hosts", default=None,
                     help="comma-separated host:port list, the chief first "
                     "(default %s)" % _DEFAULT_WORKERS)
  parser.add_argument(
      "--backups", type=int,
      default=int(os.environ.get("SYNC_REPLICAS_BACKUPS", "0")),
      help="replicas an update may go without (default: $SYNC_REPLICAS_BACKUPS"
      " as set by sync-replicas-launch --backup, else 0)")


def resolve(args, environ=None):
  """Returns this process's ``Task`` from TF_CONFIG, or else from the flags.

  Args:
    args: Parsed arguments of a parser given ``add_cluster_flags``.
    environ: The environment to read TF_CONFIG from (default ``os.environ``).

  Raises:
    SystemExit: With what was expected, what arrived and how to fix it, for a
      malformed TF_CONFIG, flags given together with TF_CONFIG, missing flags
      or a backup count that leaves no replica to aggregate.
  """
  environ = os.environ if environ is None else environ
  raw = environ.get("TF_CONFIG", "").strip()
  flags_given = [f for f in ("job_name", "task_index", "ps_hosts",
                             "worker_hosts") if getattr(args, f) is not None]
  if raw:
    if flags_given:
      raise SystemExit(
          "TF_CONFIG is set, and so are --%s: pick one. Unset TF_CONFIG to use "
          "the flags, or drop the flags." % ", --".join(flags_given))
    jobs, job_name, task_index = _from_tf_config(raw)
  else:
    if args.job_name is None or args.task_index is None:
      raise SystemExit(
          "No cluster given: set TF_CONFIG (sync-replicas-launch does) or "
          "pass --job_name {ps,worker} and --task_index N (with --ps_hosts and "
          "--worker_hosts unless the defaults %s and %s fit)."
          % (_DEFAULT_PS, _DEFAULT_WORKERS))
    jobs = {"ps": _hosts(args.ps_hosts or _DEFAULT_PS),
            "worker": _hosts(args.worker_hosts or _DEFAULT_WORKERS)}
    job_name, task_index = args.job_name, args.task_index
  if job_name not in jobs or not 0 <= task_index < len(jobs[job_name]):
    raise SystemExit(
        "This task is %s:%d, but the cluster has %s. Fix the task index or "
        "the host lists." % (job_name, task_index,
                             {j: len(h) for j, h in jobs.items()}))
  if not jobs.get("ps"):
    raise SystemExit("The cluster has no ps task; these examples keep the "
                     "variables on ps tasks, so give at least one.")
  has_chief = bool(jobs.get("chief"))
  num_replicas = len(jobs.get("chief", ())) + len(jobs.get("worker", ()))
  if num_replicas < 1:
    raise SystemExit("The cluster has no chief or worker task to train.")
  if not 0 <= args.backups < num_replicas:
    raise SystemExit(
        "--backups must be in [0, %d) for %d replicas, got %d."
        % (num_replicas, num_replicas, args.backups))
  if job_name == "chief":
    replica_index = 0
  elif job_name == "worker":
    replica_index = task_index + (1 if has_chief else 0)
  else:
    replica_index = None
  return Task(cluster=tf.train.ClusterSpec(jobs), job_name=job_name,
              task_index=task_index, is_chief=replica_index == 0,
              replica_index=replica_index, num_replicas=num_replicas)


def _hosts(text):
  return [h.strip() for h in text.split(",") if h.strip()]


def _from_tf_config(raw):
  try:
    config = json.loads(raw)
    jobs = {job: list(hosts) for job, hosts in config["cluster"].items()}
    job_name = config["task"]["type"]
    task_index = int(config["task"]["index"])
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise SystemExit(
        "TF_CONFIG must be JSON like {\"cluster\": {\"ps\": [\"host:port\"], "
        "\"worker\": [...]}, \"task\": {\"type\": \"worker\", \"index\": 0}}; "
        "got %r (%s: %s)." % (raw[:200], type(e).__name__, e)) from None
  # Estimator-era configs may name the evaluator; it is not part of training.
  jobs.pop("evaluator", None)
  return jobs, job_name, task_index


def start_server(task):
  """Starts this task's gRPC server and returns it.

  A ps task's server starts with ``sync_replicas.ps_server_config()``: its
  idle threads sleep instead of spinning, CPU left to the workers.
  """
  config = sync_replicas.ps_server_config() if task.job_name == "ps" else None
  return tf.distribute.Server(task.cluster, job_name=task.job_name,
                              task_index=task.task_index, config=config,
                              start=True)


def serve_forever(server, task):
  """A ps task's whole life: serve variables until the process is stopped.

  ``server.join()`` never returns; sync-replicas-launch (or the cluster
  manager) ends ps tasks once every replica has finished.
  """
  # Under sync-replicas-launch nothing is for the reader to do: the launch
  # stops it. Started by hand it serves until killed; Ctrl-C does not reach
  # Python while join() waits in TensorFlow's C++.
  _LOG.info("%s serving at %s until stopped (sync-replicas-launch stops "
            "it once every replica is done; started by hand: kill %d)",
            name(task), task.cluster.task_address("ps", task.task_index),
            os.getpid())
  server.join()


def worker_device(task):
  return "/job:%s/task:%d" % (task.job_name, task.task_index)


def session_config(task, *, op_timeout_ms=120_000):
  """A ConfigProto that sees only the ps tasks and this replica.

  Without the device filters a replica's session waits for every other task
  to be up, and a replica that finishes early stalls the others' sessions.
  The op timeout turns a lost ps into an error instead of a hang.
  """
  return tf.compat.v1.ConfigProto(
      device_filters=["/job:ps", worker_device(task)],
      operation_timeout_in_ms=op_timeout_ms)


#: How often ``wait_for_chief`` says it is still waiting, and on what.
WAIT_LOG_SECS = 30.0


def wait_for_chief(target, uninitialized_op, config, *, timeout=300.0):
  """Blocks until the chief has initialized the model, polling every 0.5 s.

  A non-chief's session creation otherwise finds the model uninitialized and
  sleeps SessionManager's fixed 30 s recovery wait before looking again, and
  every task of a freshly launched cluster starts at the same moment.
  ``sync_replicas.wait_for_chief_init`` does it, through ps restarts (a
  failed poll's session is replaced: it may not answer again for minutes).

  Args:
    target: This replica's server target.
    uninitialized_op: An op listing uninitialized global variables (empty
      when the chief is done), built in the default graph.
    config: The session's ConfigProto.
    timeout: Seconds to wait before giving up.

  Raises:
    SystemExit: If the chief has not initialized the model within ``timeout``.
  """
  try:
    sync_replicas.wait_for_chief_init(target, uninitialized_op, config=config,
                                      timeout_secs=timeout,
                                      log_secs=WAIT_LOG_SECS)
  except TimeoutError as e:
    raise SystemExit(str(e)) from None

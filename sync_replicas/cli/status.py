"""Prints the live sync state of a running sync_replicas job, read-only.

  sync-replicas-status --manifest ckpt/sync_manifest.json --ps 10.0.0.5:2222
  sync-replicas-status --manifest ckpt/ --watch --interval 5      # TF_CONFIG's ps

Shows the global step, the tokens in ``sync_token_q``, and for every
accumulator how many fresh gradients it holds against the
``replicas_to_aggregate`` an update needs, then what the next update waits
for. ``--watch`` refreshes every ``--interval`` seconds (until ``--count``
snapshots or Ctrl-C) and flags the job as stuck once the global step has not
moved for ``--stall-secs``. While an update waits, it also reads every
replica's ``sync_rep_local_step`` on its own task (one bounded read each) and
says which replicas' pushes are stale, with the chief's stall log line's
words.

The job's layout comes from its sync manifest: the chief writes it with
``opt.write_sync_manifest(checkpoint_dir)`` (TensorFlow has no public way to
list a ps task's resources). The tool connects a session to one task of the
cluster (``--target``, else the first ``--ps`` address, else TF_CONFIG's
first ps task), sees only the jobs that hold sync state, and runs nothing but
``num_accumulated``, the queues' ``size`` and reads of the global and local
steps: it never takes, dequeues or assigns, so it cannot change training.
A cluster that sync-replicas-launch confined to its network namespace is
reached there: the tool enters the namespace of the running confined launch
that the manifest names (its writer records its network namespace: the
launch's own, or with --hosts an emulated host's inside it), or, for a
target on 127.0.0.1 and a manifest without that record, of the one launch
whose namespace listens on the target's port, and says so. With several
such launches it asks for one:

  sync-replicas-launch --enter PID -- sync-replicas-status --manifest runs/x --ps 127.0.0.1:2222

Exit code: 0; 1 if the state could not be read, the job having ended
included (the reason on stderr, in one line); 2 for bad arguments, a
--manifest naming no file included; 130 on Ctrl-C (how a --watch without
--count ends).
"""

import json
import os
import sys
import time
import typing

from sync_replicas import _process
from sync_replicas.cli import _cli
from sync_replicas.cli import _confine
from sync_replicas.cli import launch

PROG = "sync-replicas-status"


def _parse(argv):
  parser = _cli.parser(PROG, __doc__)
  parser.add_argument("--manifest", required=True,
                      help="the job's sync_manifest.json, or the directory "
                      "(e.g. the chief's checkpoint_dir) holding it")
  parser.add_argument("--target", type=_cli.address,
                      help="session target, e.g. grpc://10.0.0.5:2222 "
                      "(default: the first ps)")
  parser.add_argument("--ps", type=_cli.addresses, default="",
                      help="comma-separated ps addresses host:port")
  parser.add_argument("--worker", type=_cli.addresses, default="",
                      help="comma-separated worker addresses (used as the "
                      "target when there is no ps)")
  parser.add_argument("--watch", action="store_true",
                      help="refresh until --count snapshots or Ctrl-C")
  parser.add_argument("--interval", type=float, default=2.0,
                      help="seconds between --watch snapshots")
  parser.add_argument("--count", type=int, default=0,
                      help="with --watch, stop after this many snapshots "
                      "(0: until Ctrl-C)")
  parser.add_argument("--stall-secs", type=float, default=60.0,
                      help="with --watch, call the job stuck when the global "
                      "step has not moved for this long")
  parser.add_argument("--timeout", type=float, default=10.0,
                      help="seconds any read may take, connecting included")
  args = parser.parse_args(argv)
  if args.interval <= 0 or args.count < 0 or args.timeout <= 0:
    parser.error("--interval and --timeout must be > 0 and --count >= 0, got "
                 "%s, %s and %s" % (args.interval, args.timeout, args.count))
  return args


def _target(args):
  """The session target: --target, --ps, --worker, then TF_CONFIG."""
  if args.target:
    return (args.target if args.target.startswith("grpc://")
            else "grpc://" + args.target)
  for addresses in (args.ps, args.worker):
    if addresses:
      return "grpc://" + addresses[0]
  try:
    cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get(
        "cluster", {})
  except (ValueError, AttributeError) as e:
    raise ValueError("TF_CONFIG is not a JSON object with a 'cluster' "
                     "(%s): pass --ps host:port instead" % e) from None
  for job in ("ps", "chief", "worker"):
    if cluster.get(job):
      return "grpc://" + cluster[job][0]
  raise ValueError(
      "No cluster to connect to: pass --target grpc://host:port, --ps "
      "host:port[,...] or set TF_CONFIG (got none of them).")


def main(argv: "typing.Sequence[str] | None" = None, *,
         out: "typing.TextIO | None" = None,
         clock: "typing.Callable[[], float]" = time.monotonic) -> int:
  """The console script ``sync-replicas-status``; returns the exit code.

  Args:
    argv: The arguments (default: the command line's).
    out: Where the snapshots go (default: stdout); errors go to stderr.
    clock: Seconds, for ``--stall-secs`` (tests pass their own).
  """
  started = time.monotonic()  # An error says how long it took, all told.
  refused = _before_threads(argv)
  if refused is not None:
    return refused
  if argv is None and "tensorflow" not in sys.modules:
    _without_keras()  # The command's own process: TensorFlow's import next.
  # Ctrl-C ends it at once: it only reads, and holds no process or file.
  return _cli.run(
      lambda a: _main(a, out=out or sys.stdout, clock=clock, started=started),
      argv, prog=PROG, exit_at_once=True)


def console() -> "typing.NoReturn":
  """The console script ``sync-replicas-status``: ``main()``, then, once its
  lines are flushed, the process ends on the spot with ``main``'s code.

  Python's exit would then run TensorFlow's teardown (its sessions' gRPC
  channels and threads, its C++ statics): 9-96 s after the answer (median
  35 s) at load 30-47, in which the command printed nothing and held the
  shell; 0.2-8.5 s without it (docs/operations.md).
  The tool has nothing to clean up (it only reads, writes no file, and
  leaves no process), so nothing is lost. Only the command's own process
  ends so: ``main()`` called from Python returns, and its caller's exit is
  its own.
  """
  code = main()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass  # A reader that went away (a closed pipe) misses nothing more.
  os._exit(code)  # pylint: disable=protected-access


def _without_keras():
  """Keeps Keras out of the tool's process, which reads through a session.

  ``import tensorflow`` imports Keras for ``tf.keras`` and goes on without
  it when that fails. Keras 3 imports scikit-learn and SciPy when they are
  installed (the examples extra): in a profile of the tool on a loaded
  machine, 48 of the 110 s that TensorFlow's import took; measured
  interleaved, ``import tensorflow`` cost 5.5 CPU-seconds with Keras and
  3.6 without (medians of 3, TensorFlow 2.21, 0.64 the ratio's median).
  Only in a process of its own (the command), which imports TensorFlow
  after this.
  """
  for name in ("keras", "tf_keras"):
    sys.modules.setdefault(name, None)  # An import of it raises ImportError.


#: The manifest's file name in a directory (``_manifest.FILE_NAME``, which
#: imports TensorFlow).
MANIFEST_FILE = "sync_manifest.json"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


def _local_manifest(path):
  """``(file, reason)`` for the manifest at ``path``, before TensorFlow's
  import, so that a missing one is reported at once: the local file and
  None; None and why there is none; or (None, None) for a URL such as
  gs://..., which only TensorFlow reads."""
  if "://" in path:
    return None, None
  file = os.path.join(path, MANIFEST_FILE) if os.path.isdir(path) else path
  if os.path.isfile(file):
    return file, None
  # Said for a job that is starting too: its chief writes the manifest
  # only once its graph is built, seconds after a hint to run this tool
  # was printed (the demo prints it before the launch).
  return None, ("No sync manifest at %s. The job's chief writes it with "
                "opt.write_sync_manifest(checkpoint_dir) once its graph is "
                "built, some seconds after it starts (the examples write it "
                "to their --logdir): for a job that is starting, run this "
                "again in a few seconds; else pass that file or directory."
                % file)


def _recorded(file, key):
  """The manifest's ``key``, or None (not recorded, or no manifest to read:
  reported later, in its words)."""
  try:
    with open(file, encoding="utf-8") as f:
      return json.load(f).get(key)
  except (OSError, ValueError, AttributeError):
    return None


def _recorded_namespace(file):
  """The network namespace the manifest's writer ran in, or None."""
  found = _recorded(file, "network_namespace")
  return found if isinstance(found, int) else None


def _has_ended(file, target, namespace):
  """Why the job whose manifest is ``file`` has ended, or None.

  Told only for a target on loopback, where this machine's processes are
  the whole story: the namespace the job ran in holds no process any more
  (a confined launch that ended), or the chief that wrote the manifest has
  exited and nothing of this namespace listens on the target's port. Said
  at once, instead of after a read's timeout that would end in "could not
  reach".
  """
  host, _, port = target[len("grpc://"):].rpartition(":")
  if host not in _LOOPBACK_HOSTS:
    return None
  if namespace is not None and namespace != os.stat(
      "/proc/self/ns/net").st_ino:
    if _namespace_in_use(namespace):
      return None
    return ("the network namespace it ran in (a confined launch's) holds no "
            "process that this user may see any more")
  writer = _recorded(file, "writer")
  if _process.has_exited(writer) and not _confine.listens(int(port)):
    return ("its chief (pid %d) has exited, and nothing listens on port %s "
            "any more" % (writer["pid"], port))
  return None


def _ended_line(file, target, namespace):
  """The tool's line saying that the job has ended, or None."""
  if not (file and target and sys.platform.startswith("linux")):
    return None
  why = _has_ended(file, target, namespace)
  if not why:
    return None
  return ("the job that wrote %s has ended: %s. Its sync state ended with "
          "it; its checkpoints, logs and timeline (if it recorded one: "
          "sync-replicas-timeline DIR) remain." % (file, why))


def _namespace_in_use(namespace):
  """Whether a process that this user may see runs in the network namespace
  ``namespace`` (its inode)."""
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if os.stat("/proc/%s/ns/net" % entry).st_ino == namespace:
          return True
      except OSError:
        continue  # Ended meanwhile, or not ours to look into.
  return False


def _enter_confined_launch(target, namespace):
  """Enters the namespace of the confined launch that runs the job.

  Only in a process without threads:
  the tool run as a command, before TensorFlow's import (a user namespace
  admits no process with threads, and a network namespace would hold only
  the calling thread). Called in a process with threads (a test's), it
  leaves the namespace alone. The launch is the one whose namespace the
  manifest names (``namespace``, as its writer recorded it: with --hosts,
  an emulated host's namespace inside the launch's, whose bridge reaches
  every host); without a record, for a target on loopback, the one whose
  namespace listens on the target's port, when nothing of this namespace
  does.

  Returns:
    None, or the reason the tool cannot choose (several launches).
  """
  host, _, port = target[len("grpc://"):].rpartition(":")
  if _confine.thread_count() > 1:
    return None
  if namespace is not None:
    if namespace == os.stat("/proc/self/ns/net").st_ino:
      return None
    pids = launch.confined_launches(namespace=namespace)
  elif host not in _LOOPBACK_HOSTS or _confine.listens(int(port)):
    return None
  else:
    pids = launch.confined_launches(port=int(port))
  if len(pids) > 1:
    return ("%d confined launches (pids %s) serve port %s, each in its own "
            "network namespace: pick one with sync-replicas-launch --enter "
            "PID -- %s ..." % (len(pids), ", ".join(map(str, pids)), port,
                               PROG))
  if pids:
    try:
      _confine.enter(pids[0])
    except _confine.CannotConfine as e:
      return "cannot enter the namespace of launch %d: %s" % (pids[0], e)
    _cli.say(PROG, "reading inside the network namespace of %s %d, where "
             "the job runs" % (launch.PROG, pids[0]))
  return None


def _before_threads(argv):
  """What runs before the tool starts a thread (``_cli.run``'s Ctrl-C
  waiter, TensorFlow's): a missing manifest, reported at once, and the
  confined launch to enter. Returns an exit code to end with, or None.
  """
  args = _parse(argv)
  file, missing = _local_manifest(args.manifest)
  try:
    target = _target(args)
  except ValueError:
    target = None  # Reported after the manifest is read, in its order.
  namespace = _recorded_namespace(file) if file else None
  linux = sys.platform.startswith("linux")
  ended = _ended_line(file, target, namespace)
  if ended:
    _cli.say(PROG, ended)
    return _cli.EXIT_FAILED
  if missing:
    _cli.say(PROG, missing)
    return _cli.EXIT_USAGE  # A --manifest that names no file: bad arguments.
  refused = target and linux and _enter_confined_launch(target, namespace)
  if refused:
    _cli.say(PROG, refused)
    return _cli.EXIT_FAILED
  return None


def _main(argv, *, out, clock, started):
  args = _parse(argv)
  # TensorFlow's C++ start-up lines would bury the tool's own line. 2.21
  # logs its oneDNN notice whatever TF_CPP_MIN_LOG_LEVEL says; the tool only
  # reads values, so oneDNN's kernels are of no use to it.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  # Imported only now: --help and bad arguments answer without TensorFlow.
  from sync_replicas.cli import _job_state  # pylint: disable=g-import-not-at-top
  file, _ = _local_manifest(args.manifest)

  def ended():
    # Asked again when the job does not answer: it may have ended while
    # TensorFlow loaded. In the namespace the tool may have entered since.
    try:
      target = _target(args)
    except ValueError:
      return None
    return _ended_line(file, target, _recorded_namespace(file) if file
                       else None)

  return _job_state.watch(args, find_target=lambda: _target(args), out=out,
                          clock=clock, prog=PROG, started=started,
                          ended=ended)


if __name__ == "__main__":
  console()

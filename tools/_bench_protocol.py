"""The wire protocol between tools/bench and its task processes.

Owns the one definition of what crosses between the driver (tools/bench,
through tools/_bench_pool.py) and a task process (tools/_bench_task.py): the
task's start-up spec, the run spec, the commands and the answers, and how a
message is framed. Both sides import it, so a key cannot be spelt two ways.
It imports nothing beyond the standard library: the driver needs no
TensorFlow.

A task process is started as ``python tools/_bench_task.py --serve SPEC``,
SPEC a JSON ``ServeSpec``. Every message after that is one JSON object on one
line:

* driver -> task, on the task's stdin: a command ``{"cmd": NAME, ...}``.
  ``run`` carries the fields of a ``RunSpec``; ``go`` lets a non-chief
  create its session (sent once the chief's exists); ``start`` lets every
  worker take its first step (sent once all are ready); ``exit``, or the end
  of stdin, ends the process. A ps task only waits for the end.
* task -> driver, on the task's original stdout: an answer with exactly one
  of the keys ``up`` (the server's target, with ``pid``), ``ready`` (this
  worker's session exists), ``done`` (the run's record) or ``error`` (a
  traceback).
"""

import dataclasses
import json
from typing import Optional

#: The scenarios a matrix may name. ``straggler_backup`` is the straggler
#: model with one backup: the driver sends it as ``straggler`` with one
#: replica fewer to aggregate than there are workers.
DEFAULT_SCENARIOS = ["small", "medium", "mlp", "many", "many_packed_reads",
                     "flat", "sparse", "straggler", "straggler_backup"]
#: The "many" model at V = 1000 and 4000 variables, for how costs grow with
#: V (docs/scaling.md); named, never run by default (each takes minutes).
SCALE_SCENARIOS = ["many_1000", "many_4000"]
#: The MLP with its weight matrices split over the ps tasks (one piece
#: each): how a model with one dominant matrix uses more ps tasks
#: (tools/linkcost); named, never run by default.
SPLIT_SCENARIOS = ["mlp_split"]
#: Many small variables whose gradients read them (the many model's 200
#: variables stacked into one tanh layer's matrix): what packed and
#: prefetched reads speed up when a step reads; in --peers, not in the
#: default matrix.
READ_SCENARIOS = ["many_stacked"]
SCENARIOS = (DEFAULT_SCENARIOS + SCALE_SCENARIOS + SPLIT_SCENARIOS
             + READ_SCENARIOS)
#: Stock's SyncReplicasOptimizer, ours, and the plain optimizer (no barrier).
IMPLS = ["stock", "ours", "async"]
#: The peers: tf.distribute.MultiWorkerMirroredStrategy, W worker processes
#: and no ps (tools/_bench_peer_task.py), by its collective communication:
#: its default (AUTO) and RING. Run only when --impls names them.
PEERS = {"mwms": "AUTO", "mwms_ring": "RING"}
#: Everything --impls may name.
ALL_IMPLS = IMPLS + list(PEERS)

# The key of a command, and the commands.
CMD = "cmd"
RUN = "run"
GO = "go"
START = "start"
EXIT = "exit"

# The answers: each message of a task carries exactly one of these keys.
UP = "up"
READY = "ready"
DONE = "done"
ERROR = "error"
#: Sent with ``up``: the task's process id, for the CPU accounting.
PID = "pid"


@dataclasses.dataclass(frozen=True)
class ServeSpec:
  """What a task process serves, given once on its command line.

  Attributes:
    cluster: The cluster, as ``tf.train.ClusterSpec`` takes it (job -> list
      of "host:port").
    job: "ps" or "worker".
    task: The task's index in its job.
    communication: A peer's MultiWorkerMirroredStrategy communication
      (``PEERS``' values); None for a task of tools/_bench_task.py.
    ps_config: A ps task starts its server with this ``ConfigProto``, in
      protobuf's text format (e.g. ``"experimental {
      disable_thread_spinning: true }"``); None: TensorFlow's defaults, as
      stock deployments start their servers.
  """
  cluster: dict
  job: str
  task: int
  communication: Optional[str] = None
  ps_config: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run, as every worker of the pool receives it with ``run``.

  Attributes:
    cluster: The pool's cluster (the same as every task's ServeSpec).
    scenario: The model to build (see tools/_bench_task.py's
      ``build_model``); never ``straggler_backup``, which is sent as
      ``straggler`` with fewer ``replicas``.
    impl: One of ``ALL_IMPLS`` (a peer's runs go to its own pool).
    replicas: ``replicas_to_aggregate`` of the sync optimizers.
    options: Keyword options for our optimizer (ignored by the others).
    secs: Measured seconds: ``warmup + secs`` after its first step the chief
      picks a last global step and writes it to ``stop_file``.
    warmup: Seconds before the measured window opens.
    stop_file: Where the chief writes the last global step for the others.
    straggler_delay: Seconds the last worker sleeps before every step.
    grace: ``stop_grace_period_secs`` of every worker's session.
    pool_pids: Every process of the pool: the CPU they use is the run's own,
      the rest of the machine's is noise.
    op_timeout_secs: ``operation_timeout_in_ms`` of every worker's session,
      in seconds: no single run (the first, which registers the graph, is
      the longest) may take longer.
  """
  cluster: dict
  scenario: str
  impl: str
  replicas: int
  options: dict
  secs: float
  warmup: float
  stop_file: str
  straggler_delay: float = 0.0
  grace: float = 5.0
  pool_pids: Optional[list] = None
  op_timeout_secs: float = 120.0


def serve_argument(spec):
  """The ``--serve`` argument of a task process, from its ServeSpec."""
  return json.dumps(dataclasses.asdict(spec))


def serve_spec(argument):
  """The ServeSpec a ``--serve`` argument carries."""
  return ServeSpec(**json.loads(argument))


def parse_variant(text):
  """``(name, options)`` of a ``NAME=JSON`` variant (tools/bench --variant).

  Raises ValueError, saying what was expected, unless NAME is an identifier
  other than IMPLS' and JSON an object of keyword options for ours.
  """
  name, sep, options = text.partition("=")
  try:
    options = json.loads(options) if sep else None
  except ValueError:
    options = None
  if not isinstance(options, dict):
    raise ValueError(
        "--variant takes NAME=JSON with a JSON object of options for ours, "
        "e.g. 'fused={\"fuse_dense_gradients\": true}'; got %r" % text)
  if not name.isidentifier() or name in ALL_IMPLS:
    raise ValueError("--variant %r: its NAME must be an identifier, used "
                     "once, and none of %s" % (text, ALL_IMPLS))
  return name, options


#: A --variant's option that is not the optimizer's: the text-format
#: ``ConfigProto`` the ps starts its server with (``ServeSpec.ps_config``).
#: The drivers keep it out of the options the workers get, and run the
#: variant on a pool whose ps started with it.
PS_CONFIG = "ps_config"


def pool_options(options, default=None):
  """``(optimizer options, ps_config)`` of a run's ``options``:
  ``PS_CONFIG`` taken out (``default`` when absent; "" is None)."""
  options = dict(options)
  ps_config = options.pop(PS_CONFIG, default)
  if ps_config is not None and not isinstance(ps_config, str):
    raise ValueError(
        "%r must be a ConfigProto in protobuf's text format, e.g. "
        "\"experimental { disable_thread_spinning: true }\", got %r" % (
            PS_CONFIG, ps_config))
  return options, ps_config or None


def command(name, spec=None):
  """The command ``name``; ``run`` carries the fields of ``spec``."""
  message = {CMD: name}
  if spec is not None:
    message.update(dataclasses.asdict(spec))
  return message


def run_spec(message):
  """The RunSpec of a ``run`` command; TypeError names an unknown key."""
  fields = dict(message)
  fields.pop(CMD)
  return RunSpec(**fields)


def encode(message):
  """One message as the line that carries it."""
  return (json.dumps(message) + "\n").encode()


def decode(line):
  """The message a line carries."""
  return json.loads(line)

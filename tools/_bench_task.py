"""One task of tools/bench, as its own long-lived process.

``python tools/_bench_task.py --serve SPEC_JSON`` starts the task's
``tf.distribute.Server`` once (SPEC: a ``ServeSpec``), writes ``{"up": ...}``
on stdout and then serves runs, so that TensorFlow is imported and the server
started once per cluster, not once per run. Every key and command below is
defined once, in tools/_bench_protocol.py, which the driver imports too:

* a ps only serves its server until its stdin closes (or reads ``exit``);
* a worker reads one JSON command a line on stdin: ``{"cmd": "run", ...}``
  builds the scenario's model in a fresh ``tf.Graph`` with stock's
  SyncReplicasOptimizer, ours or the plain optimizer (async) and trains it
  under MonitoredTrainingSession for ``secs`` seconds after a warm-up (then
  the chief picks a last global step for every worker, see ``train``). The
  chief first resets every resource container of the cluster
  (``tf.compat.v1.Session.reset``: variables, accumulators and queues of the
  previous run, whose shared names would collide). Every worker writes
  ``{"ready": ...}`` once its session exists; a non-chief creates its session
  only when it reads ``{"cmd": "go"}`` (sent after the chief's ready, so it
  never sleeps SessionManager's 30 s recovery wait), and every worker takes
  its first step only when it reads ``{"cmd": "start"}`` (sent once all are
  ready: otherwise the chief, which has the initial tokens, trains alone
  while the others create their sessions). Each worker answers ``{"done":
  RECORD}`` after its session closed, or ``{"error": TRACEBACK}``: per-run
  latencies, the global step over time, its close time and its peak memory
  during the run. ``{"cmd": "exit"}`` or the end of stdin ends the process.

Answers go to the process's original stdout, one JSON object a line; fd 1 is
pointed at stderr (the task log) so that nothing else can interleave with
them.
"""

import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import sync_replicas  # pylint: disable=g-import-not-at-top

# This file runs as a script, so its folder (tools/) is sys.path[0].
import _bench_protocol as protocol  # pylint: disable=g-import-not-at-top
import _peak_rss as peak_rss  # pylint: disable=g-import-not-at-top

#: Reads timed for the reads floor (their p50 is reported).
READ_RUNS = 20


def _dense_vars(count, size):
  return [tf.compat.v1.get_variable("v%d" % i, [size],
                                    initializer=tf.zeros_initializer())
          for i in range(count)]


def _data(rng, shape):
  """A batch as Grappler sees one: not a constant.

  A model's gradients depend on its input; a bare constant here would make
  every gradient a constant, which Grappler's constant folding evaluates at
  session start (through the optimizer's gradient routes, at a cost no real
  model pays). The default's value is the same fixed draw every step.
  """
  return tf.compat.v1.placeholder_with_default(
      rng.normal(size=shape).astype(np.float32), shape)


def _linear_loss(variables, rng, *, packed_reads=False):
  # d loss / d v = x: the gradient costs nothing, so transfers dominate.
  values = (sync_replicas.read_packed(variables) if packed_reads
            else variables)
  return tf.add_n([tf.reduce_sum(v * _data(rng, v.shape)) for v in values])


#: Models of many small dense variables (100 floats each), by variable count:
#: how the costs grow with V (docs/scaling.md).
MANY = {"many": 200, "many_1000": 1000, "many_4000": 4000}
#: Many small variables whose gradients read them: (variables, floats each,
#: per-worker batch). The linear models above (small, many) have gradients
#: that are their input, d loss / d v = x, so a step's train op reads no
#: variable at all and packed or prefetched reads have nothing to speed up
#: there; this one stacks its variables into one matrix of a tanh layer
#: (h = tanh(x @ stack(v)), a squared error), whose gradients need every
#: variable's value, as a real model's do.
STACKED = {"many_stacked": (200, 100, 32)}
#: Multi-layer perceptrons: (layer sizes, per-worker batch). ``mlp`` is the
#: MNIST-sized one the issue comparing with MultiWorkerMirroredStrategy
#: measured (6 variables, 2 of them over the packing limit).
MLPS = {"medium": ([256, 1024, 512, 256, 10], 16),
        "mlp": ([784, 256, 256, 10], 32)}


#: Models whose weight matrices are split along their rows into one piece
#: per ps task (``fixed_size_partitioner``), so that the device setter
#: spreads every matrix over the ps tasks instead of putting each whole on
#: one: the model they split, by name (docs/scaling.md, tools/linkcost).
SPLIT = {"mlp_split": "mlp"}


def build_model(scenario, rng, *, ps_tasks=1):
  """The scenario's loss; variables go where the device setter puts them.

  ``ps_tasks``: how many pieces a SPLIT model's matrices are cut into.
  """
  if scenario in SPLIT:
    with tf.compat.v1.variable_scope(
        "", partitioner=tf.compat.v1.fixed_size_partitioner(ps_tasks)):
      return build_model(SPLIT[scenario], rng)
  if scenario in ("small", "straggler"):
    return _linear_loss(_dense_vars(10, 100), rng)
  if scenario in MANY:
    return _linear_loss(_dense_vars(MANY[scenario], 100), rng)
  if scenario in STACKED:
    count, size, examples = STACKED[scenario]
    matrix = tf.stack(_dense_vars(count, size))
    hidden = tf.tanh(tf.matmul(_data(rng, (examples, count)), matrix))
    target = tf.constant(rng.normal(size=(examples, size)).astype(np.float32))
    return tf.reduce_mean(tf.square(hidden - target))
  if scenario == "many_packed_reads":
    # The same model, reading its variables with sync_replicas.read_packed:
    # one transfer per ps task instead of 200 (stock's optimizer too).
    return _linear_loss(_dense_vars(200, 100), rng, packed_reads=True)
  if scenario == "flat":
    return _linear_loss(_dense_vars(1, 20_000), rng)
  if scenario in MLPS:
    sizes, examples = MLPS[scenario]
    h = _data(rng, (examples, sizes[0]))
    # Each layer's width with the next's (strict=False: the last, the
    # output's, has none).
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
      w = tf.compat.v1.get_variable("w%d" % i, [a, b])
      # Biases stay whole (a partitioner would cut them too): they are
      # small, and round-robin spreads them anyway.
      bias = tf.compat.v1.get_variable("b%d" % i, [b],
                                       initializer=tf.zeros_initializer(),
                                       partitioner=None)
      h = tf.matmul(h, w) + bias
      if i + 2 < len(sizes):
        h = tf.nn.relu(h)
    labels = tf.constant(rng.integers(0, 10, size=examples))
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                       logits=h))
  if scenario == "sparse":
    table = tf.compat.v1.get_variable("table", [100_000, 64])
    ids = tf.constant(rng.integers(0, 100_000, size=128))
    return tf.reduce_sum(tf.nn.embedding_lookup(table, ids))
  raise ValueError("unknown scenario %r" % scenario)


def train(spec, task, target, *, session_ready=None, wait_go=None,
          wait_start=None):
  """Builds the scenario in a fresh graph, trains it; returns the record.

  Args:
    spec: The run, a protocol.RunSpec. ``warmup + secs`` seconds after its
      first step the chief sets the last global step, a little ahead, in
      ``stop_file``.
    task: This worker's index.
    target: This task's server target.
    session_ready: Called once this worker's session exists.
    wait_go: Called by a non-chief before it creates its session.
    wait_start: Called before the first step: every worker starts stepping
      at once, so that no measured step is the chief training alone.
  """
  workers = len(spec.cluster["worker"])
  cluster = tf.train.ClusterSpec(spec.cluster)
  rng = np.random.default_rng(task)
  impl = spec.impl
  peak_rss.reset()
  began = time.monotonic()
  graph = tf.Graph()
  with graph.as_default(), tf.compat.v1.device(
      tf.compat.v1.train.replica_device_setter(
          cluster=cluster, worker_device="/job:worker/task:%d" % task)):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    loss = build_model(spec.scenario, rng,
                       ps_tasks=len(spec.cluster.get("ps", [])) or 1)
    opt = tf.compat.v1.train.GradientDescentOptimizer(0.001)
    stop_hook = _StopAtStep(last_step=_UNSET)
    hooks = [stop_hook]
    kwargs = {}
    if impl != "async":
      cls = (tf.compat.v1.train.SyncReplicasOptimizer if impl == "stock"
             else sync_replicas.SyncReplicasOptimizer)
      kwargs = dict(spec.options) if impl == "ours" else {}
      opt = cls(opt, replicas_to_aggregate=spec.replicas,
                total_num_replicas=workers, **kwargs)
    train_op = opt.minimize(loss, global_step=global_step)
    if impl != "async":
      hooks.append(opt.make_session_run_hook(task == 0))
    # What every step must fetch from the ps whatever the optimizer: the
    # model's variables, one tensor each (not the sparse table: the model
    # gathers rows of it on the ps). Summed on the worker into one scalar,
    # as a step consumes them there: fetching 200 tensors into Python
    # would add the client's own per-tensor cost (measured: 20 vs 17 ms).
    reads = None
    if task == 0 and spec.scenario != "sparse":
      variables = tf.compat.v1.trainable_variables()
      if spec.scenario == "many_packed_reads":
        variables = sync_replicas.read_packed(variables)
      reads = tf.add_n([tf.reduce_sum(v) for v in variables])
    shards = ps_shard_bytes(tf.compat.v1.trainable_variables())
  config = tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=int(spec.op_timeout_secs * 1000),
      device_filters=["/job:ps", "/job:worker/task:%d" % task])
  delay = spec.straggler_delay if task == workers - 1 else 0.0
  # A timed run ends as a run of a fixed number of steps would: when the
  # chief's time is up it picks a last global step a little ahead and writes
  # it to stop_file; every worker reads it between steps and stops there, as
  # under StopAtStepHook. (Were the chief to simply leave, the others' pushes
  # would go on and the end would not be the end of training, when nobody
  # pushes any more: that is what stock's chief waits out in close().)
  stop_file = spec.stop_file
  deadline = None
  step = -1
  latencies, steps_at, cpu_at = [], [], []
  first_step = None
  cpu_at_first = None
  built = time.monotonic()
  if task == 0:
    # The previous run's variables, accumulators and queues (stock's shared
    # names are fixed) must not leak into this one: clear every container on
    # every task of the cluster. All sessions of the previous run are closed.
    tf.compat.v1.Session.reset(target)
  elif wait_go is not None:
    wait_go()
  session_start = time.monotonic()
  with graph.as_default(), tf.compat.v1.train.MonitoredTrainingSession(
      master=target, is_chief=task == 0, hooks=hooks, config=config,
      stop_grace_period_secs=spec.grace, save_summaries_steps=None,
      save_summaries_secs=None, save_checkpoint_secs=None,
      log_step_count_steps=None) as sess:
    session_made = time.monotonic()
    if session_ready is not None:
      # After the chief's, the driver starts the other workers' sessions:
      # they find the model ready instead of sleeping SessionManager's 30 s
      # recovery wait.
      session_ready()
    if wait_start is not None:
      wait_start()
    started = time.monotonic()
    try:
      fetches = [train_op, global_step]
      while not sess.should_stop() and step < stop_hook.last_step:
        if (stop_hook.last_step == _UNSET
            and os.path.exists(stop_file)):
          stop_hook.last_step = read_stop(stop_file)
          continue
        if delay:
          time.sleep(delay)
        start = time.monotonic()
        _, step = sess.run(fetches)
        end = time.monotonic()
        if first_step is None:
          first_step = time.time()
          cpu_at_first = cpu_snapshot(spec.pool_pids)
          if task == 0:
            deadline = end + spec.warmup + spec.secs
        latencies.append(end - start)
        steps_at.append((end, int(step)))
        # This process's CPU (its steps, and on the chief the sync loop and
        # the ops its server runs), for the chief's CPU per update.
        cpu_at.append(time.process_time())
        if (deadline is not None and end >= deadline
            and stop_hook.last_step == _UNSET):
          stop_hook.last_step = int(step) + 2
          write_stop(stop_file, stop_hook.last_step)
    finally:
      left = time.monotonic()
      cpu_at_last = cpu_snapshot(spec.pool_pids)
  closed = time.monotonic()
  read_ms = None
  if reads is not None:
    read_ms = _time_reads(graph, target, config, reads, READ_RUNS)
  return {
      "first_global_step": steps_at[0][1] if steps_at else None,
      "task": task, "runs": len(latencies), "latencies": latencies,
      "steps_at": steps_at, "cpu_at": cpu_at, "first_step_wall": first_step,
      "close_secs": closed - left, "peak_rss_mb": peak_rss.peak_mb(),
      # Where the run's wall time went, in seconds.
      "build_secs": built - began,
      # The chief: resetting the cluster; a non-chief: waiting for "go".
      "wait_secs": session_start - built,
      "session_secs": session_made - session_start,
      # Waiting for the other workers' sessions.
      "start_secs": started - session_made,
      "train_secs": left - started,
      # p50 of a session.run that only reads the model's variables onto the
      # worker (chief only, after its session closed): the floor of a step.
      "read_ms_p50": read_ms,
      # CPU the rest of the machine used while this worker trained (after
      # its first step), in cores: the noise the run saw.
      "other_cores": other_cores(cpu_at_first, cpu_at_last),
      # The job's CPU from the chief's first step to its last: with the
      # global steps between them, the updates per CPU-second.
      "job_cpu_secs": job_cpu_secs(cpu_at_first, cpu_at_last),
      "task_cpu_secs": task_cpu_secs(cpu_at_first, cpu_at_last,
                                     spec.cluster),
      # The keyword options the optimizer was built with: what the run
      # measured (a variant's options reach the constructor, or nothing).
      "optimizer_options": kwargs,
      # Bytes of the model's trainable variables on each ps task, as the
      # device setter placed them: what a read or a push of each task's
      # share moves (tools/linkcost's floor).
      "ps_shard_bytes": shards,
      "model_bytes": sum(shards.values()),
  }


def ps_shard_bytes(variables):
  """``{"ps0": bytes, ...}``: the variables' sizes summed per ps task."""
  shards = {}
  for v in variables:
    spec = tf.DeviceSpec.from_string(v.device)
    name = "%s%d" % (spec.job, spec.task or 0)
    shards[name] = shards.get(name, 0) + (
        v.shape.num_elements() * v.dtype.base_dtype.size)
  return shards


def cpu_snapshot(pids):
  """(time, busy CPU ticks of the machine, CPU ticks of ``pids``, each
  pid's CPU ticks in ``pids``' order) or None."""
  if not pids:
    return None
  try:
    with open("/proc/stat") as f:
      ticks = [int(x) for x in f.readline().split()[1:]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # Not idle, not iowait.
    each = []
    for pid in pids:
      with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
      each.append(int(fields[11]) + int(fields[12]))  # utime + stime.
  except (OSError, ValueError, IndexError):
    return None
  return time.monotonic(), busy, sum(each), each


def job_cpu_secs(first, last):
  """CPU seconds the pool's own processes used between two ``cpu_snapshot``s
  (the whole job: ps and workers, or a peer's workers), or None."""
  if first is None or last is None:
    return None
  return (last[2] - first[2]) / os.sysconf("SC_CLK_TCK")


def task_cpu_secs(first, last, cluster):
  """``{task: CPU seconds}`` between two ``cpu_snapshot``s, each process of
  the pool named by its task (``ps0``, ``worker0``, ...; the pool lists the
  ps first), or None."""
  if first is None or last is None:
    return None
  names = ["%s%d" % (job, i) for job in ("ps", "worker")
           for i in range(len(cluster.get(job, [])))]
  return {name: (b - a) / os.sysconf("SC_CLK_TCK")
          for name, a, b in zip(names, first[3], last[3], strict=True)}


def other_cores(first, last):
  if first is None or last is None or last[0] <= first[0]:
    return None
  other = (last[1] - first[1]) - (last[2] - first[2])
  return max(other, 0) / os.sysconf("SC_CLK_TCK") / (last[0] - first[0])


def _time_reads(graph, target, config, reads, runs):
  """p50 ms of fetching ``reads``; None if a step fails (it is only a floor)."""
  try:
    with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
      fetch = sess.make_callable(reads)
      fetch()  # Registers the graph.
      times = []
      for _ in range(runs):
        start = time.monotonic()
        fetch()
        times.append(time.monotonic() - start)
  except tf.errors.OpError as e:
    print("timing the reads failed: %s" % e, file=sys.stderr)
    return None
  times.sort()
  return times[len(times) // 2] * 1000


#: The last step of a timed run until the chief sets it.
_UNSET = 1 << 62


class _StopAtStep(tf.compat.v1.train.StopAtStepHook):
  """StopAtStepHook (same per-step fetch and stop rule), last step settable."""

  @property
  def last_step(self):
    return self._last_step

  @last_step.setter
  def last_step(self, value):
    self._last_step = value


def write_stop(path, step):
  with open(path + ".tmp", "w") as f:
    f.write(str(step))
  os.replace(path + ".tmp", path)


def read_stop(path):
  with open(path) as f:
    return int(f.read())


class Channel:
  """JSON lines: commands on stdin, answers on the original stdout."""

  def __init__(self):
    self._out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # Stray prints and TF's stdout go to the task log.
    sys.stdout = os.fdopen(1, "w", buffering=1)

  def send(self, message):
    self._out.write(protocol.encode(message).decode())
    self._out.flush()

  @staticmethod
  def receive():
    line = sys.stdin.readline()
    if not line:
      return protocol.command(protocol.EXIT)
    return protocol.decode(line)


def server_config(job, ps_config):
  """The ``config`` of this task's server: for a ps, ``ps_config`` (a
  ``ConfigProto`` in text format, ``ServeSpec.ps_config``) parsed; else, or
  without one, None (TensorFlow's defaults)."""
  if job != "ps" or not ps_config:
    return None
  return text_format.Parse(ps_config, tf.compat.v1.ConfigProto())


def serve(spec):
  """Serves ``spec`` (a protocol.ServeSpec) until ``exit`` or stdin's end."""
  channel = Channel()
  cluster = tf.train.ClusterSpec(spec.cluster)
  server = tf.distribute.Server(
      cluster, job_name=spec.job, task_index=spec.task,
      config=server_config(spec.job, spec.ps_config))
  channel.send({protocol.UP: server.target, protocol.PID: os.getpid()})
  while True:
    command = channel.receive()
    if command[protocol.CMD] == protocol.EXIT:
      break
    if spec.job == "ps" or command[protocol.CMD] != protocol.RUN:
      continue

    def expect(what):
      command = channel.receive()
      if command[protocol.CMD] != what:
        raise RuntimeError("expected %r, got %r" % (what, command))

    try:
      record = train(protocol.run_spec(command), spec.task, server.target,
                     session_ready=lambda: channel.send({protocol.READY: True}),
                     wait_go=lambda: expect(protocol.GO),
                     wait_start=lambda: expect(protocol.START))
    except Exception:  # pylint: disable=broad-except
      channel.send({protocol.ERROR: traceback.format_exc()})
    else:
      channel.send({protocol.DONE: record})
  # A tf.distribute.Server cannot be stopped; leave without its destructor.
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


def main(argv):
  tf.compat.v1.disable_eager_execution()
  if len(argv) != 3 or argv[1] != "--serve":
    print(__doc__, file=sys.stderr)
    return 2
  serve(protocol.serve_spec(argv[2]))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))

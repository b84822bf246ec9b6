"""Estimator: the hook in ``train(hooks=...)``, and train() returns promptly.

``tf.compat.v1.estimator`` ships with TensorFlow up to 2.15 only (through
tensorflow-estimator); on a later TensorFlow every test here is skipped. The
sync optimizer is made before the model_fn, its hook goes to
``Estimator.train(hooks=...)`` and the model_fn calls its ``minimize``, as in
``examples/digits_estimator.py``.

* One replica, in-process master ``''`` (no TF_CONFIG): ours against stock.
  Estimator closes its session with MonitoredTrainingSession's default
  ``stop_grace_period_secs`` of 120 s and offers no knob for it, so stock's
  train() returns 120 s after its last step. Stock runs here with that grace
  patched down to 3 s (a test-only patch of Estimator's module), which shows
  the wait without spending two minutes; ours runs with the real 120 s.
* ps, chief and worker as separate processes under ``tools/launch``, each
  configured by TF_CONFIG: this file is also the program every task runs.
  Once as it is, once with ``SYNC_REPLICAS_PACK_VARIABLE_READS=1`` in the
  tasks' environment: Estimator.train with ``pack_variable_reads`` and no
  edit to the model, its reads rewired (the option's log lines), training
  and return as without it.
"""

import argparse
import functools
import logging
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import support

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: train() returning later than this after its last step waited for a grace
#: period; stock waits 120 s.
PROMPT_SECS = support.PROMPT_SECS
STEPS = 20


def _estimator_module():
  try:
    return getattr(tf.compat.v1, "estimator", None)
  except ImportError:  # A 2.15 install whose tensorflow-estimator is missing.
    return None


ESTIMATOR = _estimator_module()
pytestmark = [pytest.mark.keras, pytest.mark.skipif(ESTIMATOR is None, reason=(
    "TensorFlow %s has no tf.compat.v1.estimator (removed in 2.16); CI runs "
    "this file on 2.15 (.ci/run), or by hand: SYNC_REPLICAS_TF="
    "'tensorflow-cpu==2.15.* numpy<2' SYNC_REPLICAS_VENV=.venv-215 "
    "./tools/test tests/test_estimator.py"
    % tf.__version__))]


class _LastStep(tf.compat.v1.train.SessionRunHook):
  """Records when the last training step returned."""

  def __init__(self):
    self.at = None
    self.runs = 0

  def after_run(self, run_context, run_values):
    self.at = time.monotonic()
    self.runs += 1


class _StockRunnerBlocked(tf.compat.v1.train.SessionRunHook):
  """Holds the stop until stock's runner is inside its blocking take.

  ``end`` runs after the last step and before the session requests the
  stop: a starved runner thread still between two runs then would see the
  stop and end at once. ``at`` is when the wait ended, where the close's
  wait for the grace period begins.
  """

  def __init__(self):
    self._before = set(threading.enumerate())
    self.at = None

  def end(self, session):
    support.wait_for_stock_runner_to_block(
        [t for t in threading.enumerate() if t not in self._before])
    self.at = time.monotonic()


class _Rendezvous(tf.compat.v1.train.SessionRunHook):
  """Holds the chief's first step until the worker's session is up.

  Without it the chief, up seconds earlier, takes every token and makes
  every update alone (it may: one replica may supply all gradients), and the
  worker arrives after the last step. The worker leaves a file; the chief
  waits for it, bounded.
  """

  def __init__(self, path, *, arrive, timeout=60.0):
    self._path, self._arrive, self._timeout = path, arrive, timeout

  def after_create_session(self, session, coord):
    if self._arrive:
      self._path.touch()
      return
    deadline = time.monotonic() + self._timeout
    while not self._path.exists():
      if time.monotonic() > deadline:
        raise RuntimeError("the worker's session was not up after %.0f s (no "
                           "%s)" % (self._timeout, self._path))
      time.sleep(0.05)


def _input_fn(seed, examples=64):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(examples, 4)).astype(np.float32)
  y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
  return lambda: tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)


def _model_fn(sync_opt):
  # Two variables, not one: on a cluster both land on the one ps task, a
  # pair that pack_variable_reads can pack (a variable alone on its task and
  # dtype stays a plain read).
  def model_fn(features, labels, mode):
    w = tf.compat.v1.get_variable("w", [4], initializer=tf.zeros_initializer())
    b = tf.compat.v1.get_variable("b", [], initializer=tf.zeros_initializer())
    loss = tf.reduce_mean(
        tf.square(tf.linalg.matvec(features, w) + b - labels))
    train_op = None
    if mode == ESTIMATOR.ModeKeys.TRAIN:
      train_op = sync_opt.minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
    return ESTIMATOR.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def train(opt_cls, model_dir, *, is_chief=True, replicas=1, seed=0,
          session_config=None, hooks=(), examples=64):
  """Trains STEPS steps; returns (seconds from last step to return, runs)."""
  sync_opt = opt_cls(tf.compat.v1.train.GradientDescentOptimizer(0.05),
                     replicas_to_aggregate=replicas,
                     total_num_replicas=replicas)
  last = _LastStep()
  config = ESTIMATOR.RunConfig(
      model_dir=model_dir, session_config=session_config,
      save_summary_steps=STEPS, log_step_count_steps=STEPS)
  model = ESTIMATOR.Estimator(model_fn=_model_fn(sync_opt), config=config)
  model.train(_input_fn(seed, examples),
              hooks=[sync_opt.make_session_run_hook(is_chief), last, *hooks],
              max_steps=STEPS)
  return time.monotonic() - last.at, last.runs, model


# ------------------------------------------------------------- one replica


def test_one_replica_train_returns_promptly(tmp_path, monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  waited, runs, model = train(support.OURS, str(tmp_path),
                              session_config=support.session_config())
  # The step a run reads may lag the update it caused: one run more, at most.
  assert STEPS <= runs <= STEPS + 1
  assert model.get_variable_value("global_step") == STEPS
  assert np.any(model.get_variable_value("w") != 0)
  assert waited < PROMPT_SECS, (
      "train() returned %.1f s after its last step: it waited for the grace "
      "period" % waited)


class _SavedSteps(tf.compat.v1.train.CheckpointSaverListener):
  """Records the global step of every save its hook made."""

  def __init__(self):
    self.steps = []

  def after_save(self, session, global_step_value):
    del session
    self.steps.append(int(global_step_value))


def test_a_saver_hook_with_the_listener_in_training_chief_hooks_saves(
    tmp_path, monkeypatch):
  # docs/operations.md's Estimator recipe: the optimizer exists only once
  # model_fn runs, after train(saving_listeners=...) was called, so the
  # listener goes in a CheckpointSaverHook that model_fn returns; the
  # Estimator then adds no saver of its own.
  monkeypatch.delenv("TF_CONFIG", raising=False)
  sync_opt = support.OURS(tf.compat.v1.train.GradientDescentOptimizer(0.05),
                          replicas_to_aggregate=1, total_num_replicas=1)
  saved = _SavedSteps()

  def model_fn(features, labels, mode):
    spec = _model_fn(sync_opt)(features, labels, mode)
    saver = tf.compat.v1.train.CheckpointSaverHook(
        str(tmp_path), save_steps=5,
        listeners=[sync_opt.make_checkpoint_saver_listener(), saved])
    return spec._replace(training_chief_hooks=[saver])

  # The RunConfig's defaults would save every 600 s; left on, they must not
  # add a second saver (the Estimator checks for a CheckpointSaverHook).
  config = ESTIMATOR.RunConfig(
      model_dir=str(tmp_path), session_config=support.session_config(),
      save_summary_steps=STEPS, log_step_count_steps=STEPS)
  model = ESTIMATOR.Estimator(model_fn=model_fn, config=config)
  last = _LastStep()
  model.train(_input_fn(0), max_steps=STEPS,
              hooks=[sync_opt.make_session_run_hook(True), last])
  assert time.monotonic() - last.at < PROMPT_SECS
  # The hook saves when the session starts, every 5 steps, and at the end.
  assert saved.steps[0] == 0 and saved.steps[-1] == STEPS, saved.steps
  assert len(saved.steps) >= STEPS // 5, saved.steps
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith("-%d" % STEPS)
  assert model.get_variable_value("global_step") == STEPS


def _short_stock_grace(monkeypatch):
  """Estimator's own module calls training.MonitoredTrainingSession without
  a grace argument; give it 3 s instead of 120 s for stock's runs."""
  training = sys.modules[ESTIMATOR.Estimator.__module__].training
  monkeypatch.setattr(training, "MonitoredTrainingSession", functools.partial(
      training.MonitoredTrainingSession, stop_grace_period_secs=3))


# Stock's queue-runner thread dies by the session's close with a
# CancelledError traceback: its known behaviour, not this test's failure.
@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_stock_train_waits_for_the_grace_period(tmp_path, monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  _short_stock_grace(monkeypatch)
  blocked = _StockRunnerBlocked()
  _, runs, _ = train(support.STOCK, str(tmp_path),
                     session_config=support.session_config(), hooks=[blocked])
  waited = time.monotonic() - blocked.at
  assert STEPS <= runs <= STEPS + 1
  assert waited >= 2.5, "expected stock's wait for the (patched) grace period"


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_one_replica_gives_stocks_numbers(tmp_path, monkeypatch):
  """Side by side: the same model_fn, data and steps through Estimator.train
  with stock's class and ours end with the same variables, bit for bit.

  Every batch is the same 8 examples, so a run that pushes at the step
  boundary (the step a run reads may lag the update it caused) adds a
  gradient equal to the one it is averaged with: the numbers do not depend
  on that schedule.
  """
  monkeypatch.delenv("TF_CONFIG", raising=False)
  _short_stock_grace(monkeypatch)
  models = {}
  for name, opt_cls in [("stock", support.STOCK), ("ours", support.OURS)]:
    _, _, models[name] = train(opt_cls, str(tmp_path / name), examples=8,
                               session_config=support.session_config())
  stock, ours = models["stock"], models["ours"]
  assert (ours.get_variable_value("global_step")
          == stock.get_variable_value("global_step") == STEPS)
  np.testing.assert_array_equal(ours.get_variable_value("w"),
                                stock.get_variable_value("w"))
  assert np.any(ours.get_variable_value("w") != 0)


# ------------------------------------------------- a cluster of processes



#: Where the tasks' log lines of pack_variable_reads go (docs/options.md):
#: main() lowers this logger to DEBUG so that they reach the output.
PACKED_READS_LOGGER = "tensorflow.sync_replicas._rewired_reads"
PACKED_READS_ENV = "SYNC_REPLICAS_PACK_VARIABLE_READS"
#: transfer_dtype's, whose INFO line main() lets through the same way.
TRANSFER_LOGGER = "tensorflow.sync_replicas._transfer"
TRANSFER_ENV = "SYNC_REPLICAS_TRANSFER_DTYPE"


def _train_cluster(tmp_path, **environ):
  """ps, chief and worker under tools/launch, each running main(); asserts
  that train() returned promptly on both replicas with the step totals of
  STEPS updates of 2 gradients. Returns the launcher's output."""
  # The Estimator imports Keras, which the tests' children lack otherwise.
  env = support.with_keras(dict(
      os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
      PYTHONPATH=support.pythonpath(ROOT)))
  for name in ("TF_CONFIG", "SYNC_REPLICAS_BACKUPS", PACKED_READS_ENV,
               TRANSFER_ENV):
    env.pop(name, None)
  env.update(environ)
  cmd = [sys.executable, str(ROOT / "tools" / "launch"), "--ps", "1",
         "--workers", "2", "--timeout", "150", "--", sys.executable,
         __file__, "--model_dir", str(tmp_path)]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=180)
  finally:
    support.kill_group(proc)
  out = out.decode(errors="replace")
  assert proc.returncode == 0, "launcher exited %d:\n%s" % (
      proc.returncode, out[-6000:])
  found = {task: (waited, runs) for task, waited, runs in re.findall(
      r"\[(chief0|worker0)\] train\(\) returned ([\d.]+) s after its last "
      r"step \((\d+) runs\)", out)}
  assert set(found) == {"chief0", "worker0"}, out[-6000:]
  for task, (waited, runs) in found.items():
    assert float(waited) < PROMPT_SECS, "%s waited %s s:\n%s" % (
        task, waited, out[-4000:])
    assert int(runs) >= 1, "%s never ran a step:\n%s" % (task, out[-4000:])
  # How the steps split between the two replicas is the scheduler's choice
  # (a loaded chief once ran 1 step to the worker's 41); what the protocol
  # fixes is the total: each of the STEPS updates averaged 2 gradients and
  # every run pushes one. A run that pushed and was then stopped, waiting
  # for its token, is not counted: one per task at most.
  total = sum(int(runs) for _, runs in found.values())
  assert total >= 2 * STEPS - len(found), (
      "%d runs cannot make %d updates of 2 gradients:\n%s"
      % (total, STEPS, out[-4000:]))
  assert re.search(r"\[chief0\] global step %d" % STEPS, out), out[-4000:]
  return out


@pytest.mark.timeout(240)
def test_ps_chief_worker_processes_from_tf_config_return_promptly(tmp_path):
  out = _train_cluster(tmp_path)
  # Off by default: the lines the next test checks come from its
  # environment variable, not from main().
  assert "pack_variable_reads:" not in out, out[-4000:]
  assert "transfer_dtype:" not in out, out[-4000:]


@pytest.mark.timeout(240)
def test_estimator_train_packs_reads_from_the_environment(tmp_path):
  """pack_variable_reads in Estimator.train on a real cluster, turned on by
  the environment as for an unchanged script: no line of the model_fn or
  of main() asks for it.

  Proven here: both replicas' reads were rewired (the documented log lines,
  which main() lets through), and training ends as without the option:
  STEPS updates, each of 2 gradients, and train() returning promptly. Not
  here: the numbers. With two replicas racing for tokens they depend on the
  schedule, and the one-replica tests above run in-process, without a ps,
  where nothing crosses and nothing packs. The bit-for-bit proof stays
  tests/test_rewired_reads.py's parity test against stock, whose estimator
  style calls such a model_fn itself (no Estimator.train) with one worker
  and two ps tasks.
  """
  out = _train_cluster(tmp_path, **{PACKED_READS_ENV: "1"})
  for task in ("chief0", "worker0"):
    summary = re.findall(
        r"\[%s\].*pack_variable_reads: (\d+) reads of (\d+) variables now "
        r"cross as (\d+) packed reads" % task, out)
    assert len(summary) == 1, "%s: %r\n%s" % (task, summary, out[-6000:])
    reads, variables, packed = (int(n) for n in summary[0])
    # w and b on the one ps task, one float dtype: one packed read, a part
    # of which each read of them that crossed to this task now takes.
    assert variables == 2 and packed == 1, (task, summary, out[-6000:])
    rewired = re.findall(
        r"\[%s\].*pack_variable_reads: rewired read \S+ of (\S+) " % task,
        out)
    assert len(rewired) == reads >= 2, (task, rewired, out[-6000:])
    assert sorted(set(rewired)) == ["b", "w"], (task, rewired, out[-6000:])


@pytest.mark.timeout(240)
def test_estimator_train_sends_16_bits_from_the_environment(tmp_path):
  """transfer_dtype in Estimator.train on a real cluster, turned on only by
  the environment (with packed reads): both replicas' packed push of w and
  b and their packed read cross as bfloat16 (the documented line), and
  training ends as without it. The numbers' proof is
  tests/test_transfer_dtype.py, as for packed reads."""
  out = _train_cluster(tmp_path, **{PACKED_READS_ENV: "1",
                                    TRANSFER_ENV: "bfloat16"})
  for task in ("chief0", "worker0"):
    said = re.findall(r"\[%s\].*transfer_dtype: (\d+) float32 tensors per "
                      r"step now cross as bfloat16" % task, out)
    assert said == ["2"], (task, said, out[-6000:])


def main(argv=None):
  """One task of the cluster test; tools/launch sets its TF_CONFIG."""
  from examples import _task  # pylint: disable=g-import-not-at-top
  from examples import digits_estimator  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser()
  parser.add_argument("--model_dir", required=True)
  _task.add_cluster_flags(parser)
  args = parser.parse_args(argv)
  # Logging only, not the option: pack_variable_reads' own lines reach the
  # output, one per rewired read and its INFO summary, if it is on.
  logging.getLogger(PACKED_READS_LOGGER).setLevel(logging.DEBUG)
  logging.getLogger(TRANSFER_LOGGER).setLevel(logging.INFO)
  # Its first use gives TensorFlow's logger the handler (to stderr) that
  # the child's lines go through.
  tf.get_logger()
  task = _task.resolve(args)
  server = _task.start_server(task)
  if task.job_name == "ps":
    _task.serve_forever(server, task)
    return 0
  config = _task.session_config(task, op_timeout_ms=30_000)
  if not task.is_chief:
    # Without it the worker's session naps SessionManager's 30 s.
    digits_estimator._wait_for_global_step(task, server)  # pylint: disable=protected-access
  waited, runs, model = train(
      support.OURS, args.model_dir,
      is_chief=task.is_chief, replicas=task.num_replicas,
      seed=task.replica_index, session_config=config,
      hooks=[_Rendezvous(pathlib.Path(args.model_dir) / "worker-up",
                         arrive=not task.is_chief)])
  print("train() returned %.2f s after its last step (%d runs)"
        % (waited, runs), flush=True)
  if task.is_chief:
    print("global step %d" % model.get_variable_value("global_step"),
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""The opt-in patch (``sync_replicas.patch``) and its runner.

In this process: ``install()`` makes every public path to stock's class give
ours, ``isinstance`` against stock's name accepts ours, tf-slim's own
training loop accepts ours only while patched, ``uninstall()`` puts
everything back, an unknown layout is refused with nothing left patched.
Every test that installs uninstalls in a fixture, whatever happens.

In child processes: ``python -m sync_replicas.patch`` runs a program as
``python`` would (argv, ``sys.path[0]``, ``__name__``, exit codes, signals,
tracebacks byte for byte), patches nothing before the program's own
``import tensorflow``, and refuses bad arguments with exit code 2. The
programs that need no TensorFlow import none, so most children start in
well under a second. The process clusters of every driving pattern, run as
written and under the runner, are tests/test_user_scripts.py's.
"""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

import support
import sync_replicas
from sync_replicas import patch

tf_slim = support.require(
    "tf_slim", why="tests/test_patch.py checks tf-slim's isinstance check")

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: A child that imports no TensorFlow ends in about a second; one that does,
#: in several. Far above either on a loaded machine.
CHILD_SECS = 120
RUNNER = [sys.executable, "-m", "sync_replicas.patch"]


@pytest.fixture
def patched():
  """The patch installed for one test, and uninstalled after it."""
  installation = patch.install()
  try:
    yield installation
  finally:
    patch.uninstall()


def _stock_homes():
  import tensorflow.compat.v1 as tf1  # pylint: disable=g-import-not-at-top
  stock_module = sys.modules[
      "tensorflow.python.training.sync_replicas_optimizer"]
  return {
      "tf.compat.v1.train": lambda: tf.compat.v1.train.SyncReplicasOptimizer,
      "tensorflow.compat.v1 as tf: tf.train":
          lambda: tf1.train.SyncReplicasOptimizer,
      "tf.compat.v2.compat.v1.train":
          lambda: tf.compat.v2.compat.v1.train.SyncReplicasOptimizer,
      "sync_replicas_optimizer module":
          lambda: stock_module.SyncReplicasOptimizer,
  }


def _gd():
  return tf.compat.v1.train.GradientDescentOptimizer(0.1)


def test_install_points_every_public_path_to_ours(patched):
  assert patched.installed_here and patch.is_installed()
  for where, read in _stock_homes().items():
    assert read() is sync_replicas.SyncReplicasOptimizer, where
  with tf.Graph().as_default():
    opt = tf.compat.v1.train.SyncReplicasOptimizer(_gd(),
                                                   replicas_to_aggregate=1)
    assert isinstance(opt, sync_replicas.SyncReplicasOptimizer)
    assert isinstance(opt, tf.compat.v1.train.SyncReplicasOptimizer)
    # Side by side while patched: stock's class is still reachable.
    stock = patch.stock_class()
    assert stock is not sync_replicas.SyncReplicasOptimizer
    assert stock.__module__ == (
        "tensorflow.python.training.sync_replicas_optimizer")
    assert not isinstance(opt, stock)
    assert isinstance(stock(_gd(), replicas_to_aggregate=1), stock)


def test_uninstall_puts_stock_back_everywhere_and_both_are_idempotent():
  stock = patch.stock_class()
  first = patch.install()
  second = patch.install()
  try:
    assert first.installed_here and not second.installed_here
    assert len(patch.replaced()) == len(set(patch.replaced())) >= 2
  finally:
    patch.uninstall()
    patch.uninstall()
  assert not patch.is_installed() and patch.replaced() == []
  for where, read in _stock_homes().items():
    assert read() is stock, where


def test_context_manager_undoes_only_what_it_installed():
  stock = patch.stock_class()
  with patch.install():
    assert tf.compat.v1.train.SyncReplicasOptimizer is (
        sync_replicas.SyncReplicasOptimizer)
  assert tf.compat.v1.train.SyncReplicasOptimizer is stock
  with patch.install():
    with patch.install():  # Already installed: leaving it keeps the patch.
      pass
    assert patch.is_installed()
  assert not patch.is_installed()


def _slim_train_once(opt_cls, logdir):
  """tf-slim's own train() on one worker, as a zoo script calls it."""
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  graph = tf.Graph()
  with graph.as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        ps_tasks=1, worker_device="/job:worker/task:0")):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      w = tf.compat.v1.get_variable("w", initializer=tf.constant([1.0, 2.0]))
      opt = opt_cls(_gd(), replicas_to_aggregate=1, total_num_replicas=1)
      train_op = tf_slim.learning.create_train_op(
          tf.reduce_sum(w * w), opt, global_step=global_step)
      tf_slim.learning.train(
          train_op, str(logdir), graph=graph, master=cluster.worker_targets[0],
          is_chief=True, global_step=global_step, number_of_steps=3,
          sync_optimizer=opt, session_config=support.session_config(),
          log_every_n_steps=0, save_summaries_secs=0, save_interval_secs=0)
  return opt


# The unpatched run fails inside slim.learning.train, on purpose; its
# Supervisor has closed the summary writer by then, and TensorFlow warns
# when the stopping Supervisor writes to it: the failure's echo, expected.
@pytest.mark.filterwarnings(
    "ignore:Attempting to use a closed FileWriter:UserWarning")
def test_tf_slim_train_accepts_ours_only_while_patched(tmp_path):
  # Unpatched, tf-slim's isinstance check sends ours down its wrong path.
  with pytest.raises(TypeError, match="not iterable"):
    _slim_train_once(sync_replicas.SyncReplicasOptimizer, tmp_path / "a")
  with patch.install():
    opt = _slim_train_once(tf.compat.v1.train.SyncReplicasOptimizer,
                           tmp_path / "b")
  assert isinstance(opt, sync_replicas.SyncReplicasOptimizer)


def test_an_unknown_layout_is_refused_naming_the_version(monkeypatch):
  stock = patch.stock_class()
  # As in a TensorFlow whose v1 API no longer holds the class there.
  monkeypatch.delattr(tf.compat.v1.train, "SyncReplicasOptimizer")
  with pytest.raises(patch.UnknownLayoutError) as raised:
    patch.install()
  assert tf.__version__ in str(raised.value)
  assert "tensorflow._api.v2.compat.v1.train" in str(raised.value)
  assert "Nothing is patched" in str(raised.value)
  assert not patch.is_installed()
  assert sys.modules["tensorflow.python.training.sync_replicas_optimizer"] \
      .SyncReplicasOptimizer is stock


def test_a_path_left_unpatched_undoes_the_patch(monkeypatch):
  """The check after patching: a program's path that still gives stock's
  class (here a stand-in module no scan would find) rolls everything back."""
  stock = patch.stock_class()
  holder = type(sys)("stand_in_api")
  holder.train = type(sys)("stand_in_api.train")
  holder.train.SyncReplicasOptimizer = stock
  monkeypatch.setitem(sys.modules, "stand_in_api", holder)
  monkeypatch.setattr(patch, "_ACCESS_PATHS",
                      patch._ACCESS_PATHS + (("stand_in_api", "train", True),))  # pylint: disable=protected-access
  with pytest.raises(patch.UnknownLayoutError,
                     match=r"stand_in_api\.train\.SyncReplicasOptimizer"):
    patch.install()
  assert not patch.is_installed()
  assert tf.compat.v1.train.SyncReplicasOptimizer is stock


def test_a_module_that_bound_stock_before_install_is_named(monkeypatch,
                                                            caplog):
  early = type(sys)("early_user_module")
  early.SyncReplicasOptimizer = patch.stock_class()
  monkeypatch.setitem(sys.modules, "early_user_module", early)
  with caplog.at_level("WARNING", logger="sync_replicas.patch"):
    with patch.install():
      pass
  assert "early_user_module" in caplog.text


def test_importing_the_package_patches_nothing_and_loads_no_tensorflow():
  code = textwrap.dedent("""
      import sys
      import sync_replicas, sync_replicas.patch
      assert "tensorflow" not in sys.modules, "imported TensorFlow"
      import tensorflow as tf
      cls = tf.compat.v1.train.SyncReplicasOptimizer
      assert cls.__module__.startswith("tensorflow."), cls
      assert not sync_replicas.patch.is_installed()
      assert sync_replicas.SyncReplicasOptimizer is not cls
      print("ok")
  """)
  done = _run([sys.executable, "-c", code])
  assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-3000:]


# --- The runner ------------------------------------------------------------


def _run(argv, **kwargs):
  env = dict(os.environ, PYTHONPATH=support.pythonpath(ROOT))
  return subprocess.run(argv, capture_output=True, text=True, env=env,
                        timeout=CHILD_SECS, stdin=subprocess.DEVNULL,
                        check=False, **kwargs)


def _script(tmp_path, name, body):
  path = tmp_path / name
  path.write_text(textwrap.dedent(body))
  return path


_SHOWS_ITSELF = """
    import sys
    print(__name__, sys.argv, sys.path[0], "tensorflow" in sys.modules)
    sys.exit(int(sys.argv[1]))
"""


def test_runner_gives_the_program_what_python_gives(tmp_path):
  script = _script(tmp_path / "sub" if (tmp_path / "sub").mkdir() else
                   tmp_path / "sub", "shows.py", _SHOWS_ITSELF)
  args = ["7", "--flag=x", "-m", "--"]
  plain = _run([sys.executable, str(script)] + args, cwd=tmp_path)
  ours = _run(RUNNER + [str(script)] + args, cwd=tmp_path)
  assert plain.returncode == ours.returncode == 7
  assert ours.stdout == plain.stdout, (ours.stdout, plain.stdout)
  assert plain.stdout.startswith("__main__ ['%s', '7', '--flag=x', '-m', "
                                 "'--'] %s False" % (script, script.parent))
  assert ours.stderr == plain.stderr == ""


def test_runner_runs_a_module_as_python_m_does(tmp_path):
  package = tmp_path / "userpkg"
  package.mkdir()
  (package / "__init__.py").write_text("")
  _script(package, "train.py", _SHOWS_ITSELF)
  plain = _run([sys.executable, "-m", "userpkg.train", "3", "-x"],
               cwd=tmp_path)
  ours = _run(RUNNER + ["-m", "userpkg.train", "3", "-x"], cwd=tmp_path)
  assert plain.returncode == ours.returncode == 3
  assert ours.stdout == plain.stdout, (ours.stdout, plain.stdout)


@pytest.mark.parametrize("body", [
    "import no_such_module_of_the_program\n",
    "def f():\n  raise RuntimeError('the program failed')\nf()\n",
    "x = (\n",
], ids=["import_error", "runtime_error", "syntax_error"])
def test_runner_prints_the_programs_own_traceback(tmp_path, body):
  script = _script(tmp_path, "fails.py", body)
  plain = _run([sys.executable, str(script)])
  ours = _run(RUNNER + [str(script)])
  assert plain.returncode == ours.returncode == 1
  assert ours.stderr == plain.stderr
  assert "sync_replicas" not in ours.stderr and "runpy" not in ours.stderr


def test_runner_ends_on_an_uncaught_interrupt_as_python_does(tmp_path):
  script = _script(tmp_path, "interrupted.py", """
      import atexit
      atexit.register(lambda: print("exit handler ran"))
      raise KeyboardInterrupt
  """)
  plain = _run([sys.executable, str(script)])
  ours = _run(RUNNER + [str(script)])
  assert plain.returncode == ours.returncode == -signal.SIGINT
  assert ours.stdout == plain.stdout == "exit handler ran\n"
  assert ours.stderr == plain.stderr


def test_runner_leaves_signals_to_the_program(tmp_path):
  """A SIGTERM the program handles itself, and one it does not.

  The script waits in short sleeps, not in ``signal.pause()``: a SIGTERM
  that lands after ``print`` returns but before ``pause()`` is entered runs
  no Python handler (CPython runs handlers between bytecodes), and
  ``pause()`` then waits for a second signal that never comes. CI hit that
  window once. A sleep ends by itself, so the handler runs within 50 ms of
  the signal whenever it lands.
  """
  script = _script(tmp_path, "signalled.py", """
      import signal, sys, time
      if sys.argv[1] == "handled":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
      print("ready", flush=True)
      while True:
        time.sleep(0.05)
  """)
  for mode, expected in (("handled", 42), ("default", -signal.SIGTERM)):
    for argv in ([sys.executable, str(script), mode],
                 RUNNER + [str(script), mode]):
      env = dict(os.environ, PYTHONPATH=support.pythonpath(ROOT))
      proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env,
                              text=True, stdin=subprocess.DEVNULL,
                              start_new_session=True)
      try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=CHILD_SECS) == expected, (mode, argv)
      finally:
        support.kill_group(proc) if proc.poll() is None else None


@pytest.mark.parametrize("argv, message", [
    (["missing_script.py"], "can't open file"),
    (["-m"], "-m needs a module name"),
    (["-m", "no_such_module_anywhere"], "No module named"),
    (["--unknown-flag", "x.py"], "unknown option '--unknown-flag'"),
    ([], "expected SCRIPT or -m MODULE"),
], ids=["missing_script", "m_without_module", "unknown_module",
        "unknown_option", "nothing_to_run"])
def test_runner_refuses_bad_arguments_with_exit_code_2(tmp_path, argv,
                                                         message):
  done = _run(RUNNER + argv, cwd=tmp_path)
  assert done.returncode == 2, done
  # One line, as every tool of the package (sync_replicas/cli/_cli.py).
  assert done.stderr.startswith("sync-replicas-run: error: "), done.stderr
  assert done.stderr.count("\n") == 1 and message in done.stderr, (
      done.stderr)
  assert not done.stdout


def test_runner_help_and_version():
  helped = _run(RUNNER + ["--help"])
  assert helped.returncode == 0
  for said in ("tf.compat.v1.train.SyncReplicasOptimizer",
               "tensorflow.python.training.sync_replicas_optimizer",
               "What is not", "example:"):
    assert said in helped.stdout, said
  version = _run(RUNNER + ["--version"])
  assert version.stdout == ("sync-replicas-run (sync_replicas) %s\n"
                            % sync_replicas.__version__)


def test_runner_patches_after_the_programs_own_import_of_tensorflow(
    tmp_path):
  """TensorFlow is not loaded when the program starts (so environment
  variables it sets before its import still count: the first word printed),
  and is patched once it is."""
  script = _script(tmp_path, "user_train.py", """
      import os, sys
      loaded_early = "tensorflow" in sys.modules
      os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
      import tensorflow.compat.v1 as tf
      from tensorflow.python.training import sync_replicas_optimizer as sro
      tf.disable_eager_execution()
      gs = tf.train.get_or_create_global_step()
      v = tf.Variable([1.0])
      opt = tf.train.SyncReplicasOptimizer(
          tf.train.GradientDescentOptimizer(0.1), replicas_to_aggregate=1)
      opt.minimize(tf.reduce_sum(v * v), global_step=gs)
      print(loaded_early, type(opt).__module__,
            isinstance(opt, sro.SyncReplicasOptimizer),
            isinstance(opt, tf.train.SyncReplicasOptimizer))
  """)
  plain = _run([sys.executable, str(script)])
  ours = _run(RUNNER + [str(script)])
  assert plain.returncode == ours.returncode == 0, ours.stderr[-3000:]
  assert plain.stdout.split() == [
      "False", "tensorflow.python.training.sync_replicas_optimizer", "True",
      "True"]
  assert ours.stdout.split() == ["False", "sync_replicas.optimizer", "True",
                                 "True"]


def test_runner_says_once_that_the_program_built_ours(tmp_path):
  # Issue 38: under the runner nothing said the class was swapped.
  script = _script(tmp_path, "builds_two.py", """
      import tensorflow as tf
      for _ in range(2):
        tf.compat.v1.train.SyncReplicasOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1),
            replicas_to_aggregate=1)
      print("built")
  """)
  ours = _run(RUNNER + [str(script)])
  assert ours.returncode == 0 and ours.stdout == "built\n", ours.stderr
  said = [line for line in ours.stderr.splitlines()
          if line.startswith("sync-replicas-run: ")]
  with patch.install():
    where = ", ".join(patch.replaced())
  patch.uninstall()
  assert said == [
      "sync-replicas-run: the program's SyncReplicasOptimizer is "
      "sync_replicas.SyncReplicasOptimizer: stock's name gives ours in %s "
      "(docs/patch.md)" % where], ours.stderr
  assert "compat.v1.train" in where


def test_runner_list_names_what_install_replaces():
  done = _run(RUNNER + ["--list"])
  assert done.returncode == 0, done.stderr[-3000:]
  with patch.install():
    expected = ["%s.SyncReplicasOptimizer" % n for n in patch.replaced()]
  patch.uninstall()
  assert done.stdout.split() == expected


def test_docs_show_the_scope_word_for_word():
  page = (ROOT / "docs" / "patch.md").read_text()
  assert patch.SCOPE in page, (
      "docs/patch.md must show sync_replicas.patch.SCOPE word for word; "
      "copy the text from the code into the page's fenced block")

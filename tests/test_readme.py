"""README's quick start program, extracted and run as 1 ps + 3 worker processes.

Issue 27, item 6: the quick start did not run as written (eager mode on,
undefined names, no ps branch), and a worker started after the chief had
finished waited for good in CreateSession (no ``device_filters``). The fenced
python block under README's "Quick start" heading is the single source: each
test writes it to a file and starts it once per task on 127.0.0.1, in a start
order, each task in a process group of its own, and every process, the ps
included, must exit 0 having seen the final global step.

A task counts as started once its gRPC server accepts connections, so in
"chief last" the other three were up, and waiting, before the chief's
process began.

The start order at TensorFlow's own log level starts fresh processes, as
README does by hand: it checks every line a task prints from its start,
and it is the default tier's proof of ``python train.py`` (with the
launcher test). The other orders are repeat runs of the same command,
forked from the fork server (support.start_repeat_run): they prove the
start order, each task still README's unmodified program as ``__main__``.
"""

import importlib
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

import support
from sync_replicas import _ports
from sync_replicas.cli import launch as launch_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HEADING = "## Quick start"
#: Few steps: what is tested is how the tasks start and end, not learning.
STEPS = 20
#: Seconds for one start order to end: four TensorFlow imports (about 3
#: CPU-seconds each) on two cores that other tests share, a few seconds of
#: training, and the exits.
RUN_SECS = 150
#: Seconds for one task's server to come up (its TensorFlow import).
START_SECS = 60
# "chief0 done": README's program names its task as every line does.
_DONE = re.compile(r"^(chief|worker)(\d) done: global step (\d+),", re.M)

#: Each entry starts once the one before it has its server up; an entry
#: ``(task, [others])`` starts only once ``others`` have exited. With the
#: second value None, the tasks run at TensorFlow's own log level, as README
#: starts them by hand, and every line they print is README's program's own
#: or one docs/logs.md names; else at that TF_CPP_MIN_LOG_LEVEL.
ORDERS = [
    pytest.param(["ps", "worker0", "worker1",
                  ("worker2", ["worker0", "worker1"])], "2",
                 id="chief_first_and_a_worker_after_the_others_ended"),
    # ./tools/test leaves it to --all (and CI).
    pytest.param(["ps", "worker1", "worker2", "worker0"], "2",
                 id="chief_last", marks=pytest.mark.scale(reason=(
                     "a second proof (about 15 CPU-seconds) of a start in "
                     "any order: ps_last starts worker 2 before the chief, "
                     "the first order worker 2 after the chief ended, and "
                     "test_user_scripts starts worker 1 before the chief in "
                     "each script, which waits for the chief's init"))),
    pytest.param(["worker2", "worker0", "worker1", "ps"], None, id="ps_last"),
]
LOGS_PAGE = ROOT / "docs" / "logs.md"
#: The C++ source that logged a line: TensorFlow 2.21's ``I0000 ... port.cc:153]``
#: and 2.15's ``... I tensorflow/core/.../port.cc:113]`` alike.
_SOURCE = re.compile(r"(\w+\.cc):\d+\] ")
_ERROR = re.compile(r"^(E|F)\d{4} |: (E|F) tensorflow/")
#: Logged before TensorFlow's logging is set up (docs/logs.md, "The settings").
_EARLY = "WARNING: All log messages before absl::InitializeLog() is called"


def quick_start_program(text):
  """The complete program in the python blocks under README's quick start."""
  parts = text.split("\n" + HEADING, 1)
  assert len(parts) == 2, "README.md has no heading starting %r" % HEADING
  section = parts[1].split("\n## ", 1)[0]
  blocks = re.findall(r"^```python\n(.*?)^```$", section, re.S | re.M)
  programs = [b for b in blocks if 'if __name__ == "__main__":' in b]
  assert len(programs) == 1, (
      "want one complete program (a ```python block with `if __name__ == "
      "\"__main__\":`) under README's %r heading, found %d among %d python "
      "blocks" % (HEADING, len(programs), len(blocks)))
  return programs[0]


def test_quick_start_is_one_program_with_device_filters():
  program = quick_start_program(README.read_text())
  compile(program, "README.md quick start", "exec")
  assert "device_filters" in program
  assert "disable_eager_execution()" in program


class _Tasks:
  """The quick start's processes: one ps and three workers on free ports,
  at TF_CPP_MIN_LOG_LEVEL ``log_level`` (None: TensorFlow's default);
  fresh processes, or forked ones where ``repeat``."""

  def __init__(self, tmp_path, log_level="2", *, repeat=False):
    self._repeat = repeat
    self._dir = tmp_path
    self._program = tmp_path / "train.py"
    self._program.write_text(quick_start_program(README.read_text()))
    ports = _ports.free_ports(4)
    self.ports = dict(zip(["ps", "worker0", "worker1", "worker2"], ports,
                          strict=True))
    self._hosts = ["--ps_host", "%s:%d" % (_ports.LOOPBACK, ports[0]),
                   "--worker_hosts", ",".join(
                       "%s:%d" % (_ports.LOOPBACK, p) for p in ports[1:])]
    self._env = dict(os.environ, PYTHONPATH=support.pythonpath(ROOT),
                     TF_CPP_MIN_LOG_LEVEL=log_level or "", PYTHONUNBUFFERED="1")
    self._env.pop("TF_CONFIG", None)
    if log_level is None:
      del self._env["TF_CPP_MIN_LOG_LEVEL"]
    self.procs = {}

  def start(self, name):
    """Starts task ``name`` ("ps", "worker0"...); returns once it serves."""
    job, index = ("ps", 0) if name == "ps" else ("worker", int(name[-1]))
    start = support.start_repeat_run if self._repeat else subprocess.Popen
    with open(self.log(name), "wb") as log:
      proc = start(
          [sys.executable, str(self._program), "--job_name=%s" % job,
           "--task_index=%d" % index, "--steps=%d" % STEPS, *self._hosts],
          cwd=self._dir, env=self._env, stdout=log, stderr=subprocess.STDOUT,
          start_new_session=True)
    self.procs[name] = proc
    support.wait_until(
        lambda: proc.poll() is not None or _serves(self.ports[name]),
        timeout=START_SECS, interval=0.1,
        what="%s's server on port %d" % (name, self.ports[name]))
    assert proc.returncode is None, "%s exited %d before serving:\n%s" % (
        name, proc.returncode, self.tail(name))

  def wait_for_exit(self, names, timeout):
    def exited():
      return all(self.procs[n].poll() is not None for n in names)
    try:
      support.wait_until(exited, timeout=timeout, interval=0.1,
                         what="%s to exit" % ", ".join(names))
    except AssertionError as e:
      running = [n for n in names if self.procs[n].poll() is None]
      raise AssertionError("%s; still running: %s\n%s" % (
          e, running, "\n".join(self.tail(n) for n in running))) from None

  def log(self, name):
    return self._dir / ("%s.log" % name)

  def tail(self, name, chars=3000):
    return "--- %s:\n%s" % (name, self.log(name).read_text(
        errors="replace")[-chars:])

  def kill(self):
    for proc in self.procs.values():
      support.kill_group(proc)


def _serves(port):
  try:
    socket.create_connection((_ports.LOOPBACK, port), timeout=1).close()
  except OSError:
    return False
  return True


def _lines_logs_md_does_not_name(out, named):
  """The lines of a task's output that are neither README's program's own
  ("... done: ...") nor TensorFlow's ones that docs/logs.md names (``named``:
  the page's text): an unnamed source, an error, a stray line."""
  unnamed, after_log_line = [], False
  for line in out.splitlines():
    source = _SOURCE.search(line)
    if _ERROR.search(line) or (source and source.group(1) not in named):
      unnamed.append(line)
    elif not (source or line.startswith(_EARLY) or _DONE.match(line)
              or re.match(r"ps\d done: every replica is$", line)
              or after_log_line):  # A message's second line goes with it.
      unnamed.append(line)
    after_log_line = bool(source)
  return unnamed


@pytest.mark.timeout(4 * START_SECS + RUN_SECS + 60)
@pytest.mark.parametrize("order, log_level", ORDERS)
def test_quick_start_runs_and_every_task_exits_0(tmp_path, order, log_level):
  # The order that checks what TensorFlow prints from a task's start is
  # the fresh one; the others are repeat runs (the module docstring).
  tasks = _Tasks(tmp_path, log_level, repeat=log_level is not None)
  try:
    for entry in order:
      name, after = entry if isinstance(entry, tuple) else (entry, [])
      if after:
        tasks.wait_for_exit(after, timeout=RUN_SECS)
      tasks.start(name)
    tasks.wait_for_exit(list(tasks.procs), timeout=RUN_SECS)
  finally:
    tasks.kill()
  failed = [n for n, p in tasks.procs.items() if p.returncode != 0]
  assert not failed, "exit codes %s\n%s" % (
      {n: p.returncode for n, p in tasks.procs.items()},
      "\n".join(tasks.tail(n) for n in failed))
  for index in range(3):
    out = tasks.log("worker%d" % index).read_text(errors="replace")
    done = _DONE.findall(out)
    # By hand there is no chief job: worker 0 is the chief, as in TF 1.x.
    assert done and done[0][:2] == ("worker", str(index)), tasks.tail(
        "worker%d" % index)
    assert len(done) == 1, tasks.tail("worker%d" % index)
    # The chief stops at STEPS; an update the queue runner applies while it
    # stops may add one.
    assert STEPS <= int(done[0][2]) <= STEPS + 1, tasks.tail(
        "worker%d" % index)
  if log_level is None:
    # Issue 46, item 7: what TensorFlow prints regardless, the docs name.
    named = LOGS_PAGE.read_text()
    assert _EARLY in named
    for name in tasks.procs:
      unnamed = _lines_logs_md_does_not_name(
          tasks.log(name).read_text(errors="replace"), named)
      assert not unnamed, "%s printed lines %s does not name:\n%s" % (
          name, LOGS_PAGE.name, "\n".join(unnamed))


# ------------------------------------------------- under README's launcher


@pytest.mark.timeout(4 * START_SECS + RUN_SECS + 60)
def test_quick_start_runs_under_the_launcher(tmp_path):
  # Issue 38: README's own launch line failed in every task ("the following
  # arguments are required: --job_name, --task_index"): the launcher gives
  # TF_CONFIG, and the program read flags only.
  (tmp_path / "train.py").write_text(quick_start_program(README.read_text()))
  env = dict(os.environ, PYTHONPATH=support.pythonpath(ROOT),
             PYTHONUNBUFFERED="1")
  env.pop("TF_CONFIG", None)
  env.pop("SYNC_REPLICAS_UNCONFINED", None)
  # The launcher's `python` is the one running these tests.
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
  proc = subprocess.Popen(
      [sys.executable, str(ROOT / "tools" / "launch"), "--ps", "1",
       "--workers", "3", "--timeout", str(RUN_SECS + 2 * START_SECS), "--",
       "python", "train.py", "--steps=%d" % STEPS], cwd=tmp_path, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=RUN_SECS + 2 * START_SECS + 30)
  finally:
    support.kill_group(proc)
  out = out.decode(errors="replace")
  if proc.returncode == 2 and "cannot confine" in out:
    pytest.skip("this machine cannot confine a launch: " + out[-300:])
  assert proc.returncode == 0, out[-6000:]
  # One numbering (issue 46, item 3): each task names itself as its
  # TF_CONFIG and the launcher's label do, the chief as chief 0.
  for label, job, index in (("chief0", "chief", 0), ("worker0", "worker", 0),
                            ("worker1", "worker", 1)):
    done = re.findall(r"^\[%s\] (chief|worker)(\d) done: global step (\d+),"
                      % label,
                      out, re.M)
    assert [d[:2] for d in done] == [(job, str(index))], (label, out[-6000:])
    assert STEPS <= int(done[0][2]) <= STEPS + 1, out[-6000:]
  # README says the ps exits 0 once every replica is done: the launcher
  # lets it, and says so (it used to stop it, saying nothing).
  assert re.search(r"^\[ps0\] ps ?0 done: every replica is$", out, re.M), (
      out[-6000:])
  assert "[launch] ps0 exited 0\n" in out, out[-6000:]
  assert "ps0 stopped" not in out, out[-6000:]
  # Its last line says so in a whole sentence (the walk of issue 46 read
  # "every replica finished, and every ps task").
  assert out.endswith("[launch] every replica finished, and every ps task "
                      "ended by itself\n"), out[-6000:]
  # TF_CPP_MIN_LOG_LEVEL=2 from the launcher: none of TensorFlow's C++ INFO
  # or WARNING lines (issue 38: about 14 per task), but for 2.21's oneDNN
  # notice, which ignores it (README says so, and how to turn it off).
  logged = [line for line in re.findall(r"^\[\w+\] [IW]\d{4} .*$", out, re.M)
            if "oneDNN custom operations are on" not in line]
  assert not logged, "\n".join(logged)


# ------------------------------------------ README's commands, as printed


def _printed_commands(text):
  """The command lines of README's shell blocks that run an installed tool
  or an example, as printed (comments dropped)."""
  found, fence = [], None  # fence: the open block's language, "" for none
  for line in text.splitlines():
    if line.startswith("```"):
      fence = line[3:].strip() if fence is None else None
      continue
    if fence == "":  # A shell block (a python block's lines are code).
      command = line.split("  #", 1)[0].strip()
      if command.startswith(("sync-replicas-", "python -m examples.")):
        found.append(command)
  return found


def test_readme_activates_the_venv_its_commands_come_from():
  # Issue 38: the demo's and README's commands gave `command not found`,
  # being in .venv/bin, which nothing said.
  text = README.read_text()
  assert ". .venv/bin/activate" in text
  assert {c.split()[0] for c in _printed_commands(text)} >= {
      "sync-replicas-launch", "sync-replicas-status", "sync-replicas-run",
      "sync-replicas-timeline"}


def test_the_program_readme_has_you_save_is_not_the_projects_to_lint():
  # The walk of issue 46: README's program saved as README says, in the
  # clone's root where its commands run, made ./tools/check fail (ruff:
  # a module without a docstring, print calls).
  name = re.search(r"Save it as `([^`/]+\.py)`", README.read_text())
  assert name, "README says under which name to save its program"
  if not (ROOT / ".git").exists():
    pytest.skip("not a git checkout")
  ignored = subprocess.run(["git", "check-ignore", "-q", name.group(1)],
                           cwd=ROOT, timeout=30, check=False)
  assert ignored.returncode == 0, (
      "%s in the clone's root is neither ignored by git nor, so, by ruff"
      % name.group(1))


# Argument parsing up to --help: no TensorFlow code of its own (the commands
# and the programs train under every version in the tests above).
@pytest.mark.version_independent
def test_readme_commands_answer_help_from_the_clones_root(tmp_path):
  """Each printed command, with --help after its name, from the clone's root
  with the venv's bin first on PATH (what activating it does): the command
  exists, and its words parse up to the help. A command that runs
  ``train.py`` runs where README's program was saved under that name."""
  (tmp_path / "train.py").write_text(quick_start_program(README.read_text()))
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
  commands = _printed_commands(README.read_text())
  assert len(commands) >= 5, commands
  # A launch's program too (issue 38: `python -m examples.digits` needs the
  # clone's root, and scikit-learn).
  programs = [c.split(" -- ", 1)[1] + " --help" for c in commands
              if c.startswith("sync-replicas-launch ") and " -- " in c]
  assert programs, commands
  for command in commands + programs:
    argv = command.split()
    if argv[0] != "python":
      argv = [argv[0], "--help"] + argv[1:]
    done = subprocess.run(argv, cwd=tmp_path if "train.py" in argv else ROOT,
                          env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), (
        command, done.returncode, done.stderr[-2000:])


def _value(argv, flag, default=None):
  """The word after ``flag`` in ``argv``, else ``default``."""
  return argv[argv.index(flag) + 1] if flag in argv else default


def _digits_default_logdir(capsys):
  """examples.digits' --logdir default, as its --help states it."""
  with pytest.raises(SystemExit):
    importlib.import_module("examples.digits").main(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  found = re.search(r"--logdir LOGDIR .*?\(default: ([^)]+)\)", text)
  assert found, text
  return found.group(1)


def test_readme_commands_look_at_the_run_its_launch_makes(capsys):
  # Issue 46, items 2 and 9: README's commands are printed in the order a
  # newcomer runs them, and each reads what the launch above it writes: the
  # status tool its manifest, the timeline its timeline_dir, whose picture
  # goes inside the run's directory (it once landed in the clone's root).
  commands = _printed_commands(README.read_text())
  tools = [c.split()[0] for c in commands]
  launch = next(c for c in commands if "examples.digits" in c)
  status = next(c for c in commands if c.startswith("sync-replicas-status "))
  merge = next(c for c in commands
               if c.startswith("sync-replicas-timeline "))
  assert (commands.index(launch) < commands.index(status)
          < commands.index(merge)), tools
  program = launch.split(" -- ", 1)[1].split()
  logdir = _value(program, "--logdir") or _digits_default_logdir(capsys)
  timeline_dir = _value(program, "--timeline_dir")
  assert timeline_dir, launch
  status_argv, merge_argv = status.split(), merge.split()
  assert _value(status_argv, "--manifest") == logdir, (status, logdir)
  # The launcher's first ps listens on its base port in its namespace.
  assert _value(status_argv, "--ps") == "127.0.0.1:%s" % _value(
      launch.split(" -- ", 1)[0].split(), "--port",
      str(launch_cli.CONFINED_BASE_PORT)), status
  assert merge_argv[1] == timeline_dir, (merge, launch)
  png = _value(merge_argv, "--png")
  assert png and os.path.commonpath([png, logdir]) == os.path.normpath(
      logdir), (merge, logdir)


# ------------------------------------------ README and the docs, as text

#: README and every page of docs/, the reference README leads to.
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))
_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A project's own issue cited by number (TensorFlow's are named so).
_ISSUE = re.compile(r"(?<!TensorFlow )\b[Ii]ssues? \d+")
#: Pages that still cite one of the project's issues, each edited elsewhere
#: this session: the citation goes at the next edit of the page, and so
#: does its entry here.
_ISSUES_LEFT: dict = {}


def _prose(text):
  """A page's lines outside fenced code blocks."""
  fenced = False
  for line in text.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced:
      yield line


def _anchors(page):
  """The anchors of a page's headings, as GitHub makes them: lower case,
  punctuation dropped, spaces as hyphens, a repeated one numbered."""
  seen, found = {}, set()
  for line in _prose(page.read_text()):
    heading = re.match(r"#{1,6} (.*)", line)
    if heading:
      anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
      anchor = anchor.replace(" ", "-")
      count = seen.get(anchor, 0)
      seen[anchor] = count + 1
      found.add(anchor if not count else "%s-%d" % (anchor, count))
  return found


def test_readme_is_a_first_page_with_the_newcomers_path_first():
  # Issue 46, item 1: 305 lines, the quick start at line 94 after design
  # prose. What it is, the two commands, the quick start and what differs
  # from stock come first; the reference lives in docs/.
  lines = README.read_text().splitlines()
  assert len(lines) < 250, "README.md has %d lines" % len(lines)
  headings = [line for line in _prose(README.read_text())
              if line.startswith("## ")]
  assert headings[:3] == ["## Two commands", "## Quick start",
                          "## What differs from stock"], headings


def test_every_link_of_readme_and_the_docs_reaches_its_page_and_heading():
  broken = []
  for page in PAGES:
    for line in _prose(page.read_text()):
      for target in _LINK.findall(line):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
          continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
          broken.append("%s: %s (no such file)" % (page.name, target))
        elif anchor and linked.suffix == ".md" and (
            anchor not in _anchors(linked)):
          broken.append("%s: %s (no such heading)" % (page.name, target))
  assert not broken, "\n".join(broken)


def test_the_docs_speak_of_the_project_not_of_its_issues():
  # Issue 46, item 4: "issue 36" and "issue 17", which a reader cannot look
  # up. The docs say what the project does and why; TensorFlow's issues are
  # named as TensorFlow's.
  found = {}
  for page in PAGES:
    cited = [m.group(0) for line in _prose(page.read_text())
             for m in _ISSUE.finditer(line)]
    if cited:
      found[page.name] = cited
  assert found == _ISSUES_LEFT, found

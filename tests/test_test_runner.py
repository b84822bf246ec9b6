"""tools/_run_tests.py, the suite's scheduler, on made-up files (issue 18).

What it promises: a long file runs alone, short files share processes whose
threads stay under PROCESS_THREADS, a file it does not know runs alone and
first, the quick marker is read from the file, and the summary's per-file
lines add up the tests of each file. And tools/test's promise that a test
dependency pinned in setup.cfg's test extra is never skipped silently:
``support.require`` fails where tools/test runs it and skips elsewhere.
And two helpers whose schedules other tests rely on:
``support.wait_for_stock_runner_to_block``, on a stand-in runner thread, and
``support.held_in_turns``.
"""

import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import tensorflow as tf

import support

sys.path.insert(0, str(support.TOOLS))
import _run_tests  # pylint: disable=g-import-not-at-top

# Version-independent (tests/conftest.py): the scheduler, tools/_env.sh and
# tools/knockout run no TensorFlow: CI runs this file under its newest
# TensorFlow only.
pytestmark = [pytest.mark.quick, pytest.mark.version_independent]


@pytest.fixture
def expected(monkeypatch):
  table = {}
  monkeypatch.setattr(_run_tests, "EXPECTED", table)
  # Nothing measured on this machine either: the table is all there is.
  monkeypatch.setattr(_run_tests, "MEASURED", {})
  return table


def _files(tmp_path, names):
  paths = []
  for name in names:
    path = tmp_path / name
    path.write_text("")
    paths.append(path)
  return paths


def test_long_files_run_alone_and_short_ones_share_under_the_thread_cap(
    tmp_path, expected):
  expected.update({
      "test_long.py": (_run_tests.ALONE_SECS + 1, 10),
      "test_many_threads.py": (1, _run_tests.PROCESS_THREADS),
      "test_a.py": (10, 2_000), "test_b.py": (9, 1_500),
      "test_c.py": (8, 1_500), "test_d.py": (7, 500)})
  files = _files(tmp_path, sorted(expected))
  groups = _run_tests.pack(files, workers=2)
  names = [sorted(f.name for f in g) for g in groups]
  assert ["test_long.py"] in names
  assert ["test_many_threads.py"] in names
  shared = [g for g in groups if len(g) > 1 or g[0].name in
            ("test_a.py", "test_b.py", "test_c.py", "test_d.py")]
  # Every short file is in exactly one process, and no shared process
  # holds more threads than the cap.
  assert sorted(f.name for g in shared for f in g) == [
      "test_a.py", "test_b.py", "test_c.py", "test_d.py"]
  for group in shared:
    assert sum(expected[f.name][1] for f in group) <= (
        _run_tests.PROCESS_THREADS), names


def test_no_shared_process_is_expected_to_outlast_a_file_run_alone(
    tmp_path, expected):
  # Ten files of 0.45 ALONE_SECS in two lanes (the workers) of five: each
  # lane's shortest file its tail, the other four in two processes of 0.9
  # (one of 1.8 would outlast any file alone).
  expected.update({"test_%02d.py" % i: (0.45 * _run_tests.ALONE_SECS, 10)
                   for i in range(10)})
  groups = _run_tests.pack(_files(tmp_path, sorted(expected)), workers=2)
  lengths = [sum(expected[f.name][0] for f in g) for g in groups]
  assert sorted(len(g) for g in groups) == [1, 1, 2, 2, 2, 2], lengths
  assert max(lengths) <= _run_tests.ALONE_SECS, lengths
  assert sorted(f.name for g in groups for f in g) == sorted(expected)


def test_each_core_ends_on_a_short_process(tmp_path, expected):
  # The default run's shape: files of 2-60 s, 1,400 s in all, 4 at a time.
  # Cut into equal processes, the last two of ten ran alone for their
  # last 100 s; now each lane ends on a tail of about TAIL_SECS, and the
  # run (longest first) starts the tails last.
  sizes = [60, 55, 50, 48, 45, 40, 40, 38, 35, 33, 30, 30, 28, 27, 25, 25,
           24, 22, 20, 20, 18, 17, 16, 15, 14, 13, 12, 11, 10, 10, 9, 8, 7,
           6, 5, 4, 3, 3, 2, 2]
  sizes = [s * 1400 / sum(sizes) for s in sizes]
  expected.update({"test_%02d.py" % i: (secs, 10)
                   for i, secs in enumerate(sizes)})
  groups = _run_tests.pack(_files(tmp_path, sorted(expected)), workers=4)
  lengths = sorted(sum(expected[f.name][0] for f in g) for g in groups)
  assert sorted(f.name for g in groups for f in g) == sorted(expected)
  assert max(lengths) <= 1.1 * _run_tests.ALONE_SECS, lengths
  # Four tails, short against the rest; few processes (each an import).
  assert all(l < 2 * _run_tests.TAIL_SECS for l in lengths[:4]), lengths
  assert all(l > 2 * _run_tests.TAIL_SECS for l in lengths[4:]), lengths
  assert len(groups) <= 4 + math.ceil(1400 / _run_tests.ALONE_SECS), lengths


def test_an_unknown_file_runs_alone_and_first(tmp_path, expected):
  expected.update({"test_known.py": (_run_tests.ALONE_SECS + 100, 10)})
  files = _files(tmp_path, ["test_known.py", "test_new.py"])

  class Args:
    quick = False
    jobs = 4

  original = _run_tests.TESTS
  try:
    _run_tests.TESTS = tmp_path
    jobs = _run_tests.make_jobs(Args, [], tmp_path)
  finally:
    _run_tests.TESTS = original
  assert [j.name for j in jobs] == ["tests/test_new.py",
                                    "tests/test_known.py"]
  assert {f.name for f in files} == {f.name for j in jobs for f in j.files}


def test_quick_is_read_from_the_files_marker(tmp_path):
  quick, slow = _files(tmp_path, ["test_q.py", "test_s.py"])
  quick.write_text("import pytest\npytestmark = pytest.mark.quick\n")
  slow.write_text("import pytest\n# pytestmark = pytest.mark.quick\n")
  assert _run_tests.is_quick(quick)
  assert not _run_tests.is_quick(slow)


def test_version_independent_is_read_from_a_multi_line_marker(tmp_path):
  marked, partly, plain = _files(tmp_path, ["test_m.py", "test_p.py",
                                            "test_n.py"])
  marked.write_text("import pytest\npytestmark = [\n    pytest.mark.timeout("
                    "60),\n    pytest.mark.version_independent]\n\n\n"
                    "def test_x():\n  pytest.mark.quick\n")
  partly.write_text("import pytest\n\n\n@pytest.mark.version_independent"
                    "\ndef test_x():\n  pass\n")
  assert _run_tests.module_marks(marked) == {"timeout", "version_independent"}
  assert _run_tests.is_version_independent(marked)
  assert not _run_tests.is_version_independent(partly)
  assert not _run_tests.module_marks(plain)

  class Args:
    quick = False
    jobs = 4

  def scheduled(monkeypatch_env):
    original = _run_tests.TESTS
    try:
      _run_tests.TESTS = tmp_path
      with pytest.MonkeyPatch.context() as mp:
        for name, value in monkeypatch_env.items():
          mp.setenv(name, value)
        jobs = _run_tests.make_jobs(Args, [], tmp_path)
    finally:
      _run_tests.TESTS = original
    return sorted(f.name for j in jobs for f in j.files)

  # Only where .ci/run says so is a wholly marked file left out; a file
  # that marks some tests runs, and its marked tests skip (conftest.py).
  env = _run_tests.SKIP_VERSION_INDEPENDENT_ENV
  assert scheduled({}) == ["test_m.py", "test_n.py", "test_p.py"]
  assert scheduled({env: "1"}) == ["test_n.py", "test_p.py"]


def test_marked_tests_skip_where_told_and_each_tests_cpu_is_written(
    tmp_path):
  # A real pytest process with tests/conftest.py, as tools/test starts it:
  # the marked test is skipped, saying why, and its CPU is recorded.
  cpu_out = tmp_path / "cpu.json"
  test = ("tests/test_launcher.py::"
          "test_tf_config_names_chief_workers_and_ps_on_loopback")
  env = _run_tests.hiding_env(os.environ)
  env.update({_run_tests.SKIP_VERSION_INDEPENDENT_ENV: "1",
              _run_tests.CPU_OUT_ENV: str(cpu_out)})
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
       test], cwd=support.TOOLS.parent, env=env, capture_output=True,
      text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "1 skipped" in proc.stdout, proc.stdout
  assert "version-independent: CI runs it under its newest" in proc.stdout
  assert list(json.loads(cpu_out.read_text())) == [test]


#: A test file under tests/conftest.py (``-p conftest``): a newest_only
#: test, a parametrized test with one case left to the newest, a plain one.
_NEWEST_ONLY_FILE = """
import pytest
import support

@pytest.mark.newest_only(reason="proven under every version by test_x")
def test_marked():
  pass

@pytest.mark.parametrize("case", ["kept", "left"])
def test_cases(case):
  if case == "left":
    support.newest_only_here("proven under every version by test_y")

def test_plain():
  pass
"""


def test_newest_only_skips_in_cis_older_suite_saying_why(tmp_path):
  # A bare run (no SYNC_REPLICAS_SKIP_VERSION_INDEPENDENT) runs them all:
  # the unit test below and the whole suite on 2.21. One process here, a
  # TensorFlow import: 240 s, as test_package's, for a machine loaded many
  # times over (120 s ran out at a load average of 45 on 2 cores).
  (tmp_path / "test_marked.py").write_text(_NEWEST_ONLY_FILE)
  env = _run_tests.hiding_env(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(support.TOOLS.parent / "tests"),
                                       env["PYTHONPATH"]])
  env[_run_tests.SKIP_VERSION_INDEPENDENT_ENV] = "1"
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
       "-p", "conftest", "test_marked.py"], cwd=tmp_path, env=env,
      capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "2 passed, 2 skipped" in proc.stdout, proc.stdout
  said = proc.stdout.replace("\n", " ")
  for proof in ("test_x", "test_y"):
    assert ("newest TensorFlow only in CI (%s=1 here, TensorFlow %s): "
            "proven under every version by %s" % (
                _run_tests.SKIP_VERSION_INDEPENDENT_ENV, tf.__version__,
                proof)) in said, proc.stdout


def test_newest_only_without_a_reason_naming_the_proof_is_refused():
  for mark in (pytest.mark.newest_only, pytest.mark.newest_only(reason=""),
               pytest.mark.newest_only(reason="CI time")):
    with pytest.raises(pytest.UsageError, match="naming the tests that "
                       "prove its TensorFlow part"):
      support.newest_only_reason(mark.mark, "tests/test_x.py::test_y")
  reason = "proven under every version by test_parity"
  assert support.newest_only_reason(
      pytest.mark.newest_only(reason=reason).mark, "t") == reason


def test_newest_only_here_skips_only_in_cis_older_suite(monkeypatch):
  monkeypatch.delenv(support.OLDER_SUITE_ENV, raising=False)
  support.newest_only_here("proven under every version by test_parity")
  monkeypatch.setenv(support.OLDER_SUITE_ENV, "1")
  with pytest.raises(pytest.skip.Exception, match="newest TensorFlow only "
                     "in CI .*: proven under every version by test_parity"):
    support.newest_only_here("proven under every version by test_parity")


def test_scale_here_skips_but_under_all_and_needs_its_reason(monkeypatch):
  monkeypatch.setenv(support.ALL_TIERS_ENV, "1")
  support.scale_here("proven at a small scale by test_parity")
  monkeypatch.delenv(support.ALL_TIERS_ENV)
  with pytest.raises(pytest.skip.Exception, match="%s .*: proven at a small "
                     "scale by test_parity" % support.SCALE_SKIP):
    support.scale_here("proven at a small scale by test_parity")
  with pytest.raises(pytest.UsageError, match="naming the tests that prove "
                     "its function at a small scale"):
    support.scale_here("too slow")


#: A test file under tests/conftest.py: one test of the scale tier, one
#: of the default run.
_SCALE_FILE = """
import pytest

@pytest.mark.scale(reason="proven at a small scale by test_parity")
def test_big():
  pass

def test_small():
  pass
"""


def test_scale_tests_skip_but_under_all_and_the_run_counts_them(tmp_path):
  # Issue 46 item 10: ./tools/test leaves the scale tier out and says in
  # one line how many and how to run them; --all (its variable) runs them.
  (tmp_path / "test_tiers.py").write_text(_SCALE_FILE)
  env = _run_tests.hiding_env(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(support.TOOLS.parent / "tests"),
                                       env["PYTHONPATH"]])
  runs = {}
  for every_tier in ("", "1"):
    env[_run_tests.ALL_TIERS_ENV] = every_tier
    job = _run_tests.Job("tests/test_tiers.py", [tmp_path / "test_tiers.py"],
                         ["-q", "-rs", "-p", "no:cacheprovider", "-p",
                          "conftest"], tmp_path / every_tier)
    job.xml.parent.mkdir(exist_ok=True)
    proc = subprocess.run(job.cmd, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs[every_tier] = (proc.stdout, job)
  said, job = runs[""]
  assert "1 passed, 1 skipped" in said, said
  assert ("%s (./tools/test --all runs it, as CI does; %s=1 for a bare "
          "pytest): proven at a small scale by test_parity" % (
              _run_tests.SCALE_SKIP, _run_tests.ALL_TIERS_ENV)
          in said.replace("\n", " ")), said
  assert job.scale_skipped() == 1
  assert _run_tests.scale_line([job]) == (
      "tools/test: 1 tests of the scale tier skipped (16 workers, the soak, "
      "driving modes on emulated hosts, the benchmark tools' end-to-end "
      "runs, second proofs of what the default run proves): ./tools/test "
      "--all runs them, as CI does")
  said, job = runs["1"]
  assert "2 passed" in said, said
  assert job.scale_skipped() == 0 and _run_tests.scale_line([job]) is None
  assert support.SCALE_SKIP == _run_tests.SCALE_SKIP
  assert support.ALL_TIERS_ENV == _run_tests.ALL_TIERS_ENV


def test_scale_without_a_reason_naming_the_proof_is_refused():
  for mark in (pytest.mark.scale, pytest.mark.scale(reason=""),
               pytest.mark.scale(reason="too slow")):
    with pytest.raises(pytest.UsageError, match="naming the tests that "
                       "prove its function at a small scale"):
      support.scale_reason(mark.mark, "tests/test_x.py::test_y")
  reason = "proven at a small scale by test_parity"
  assert support.scale_reason(pytest.mark.scale(reason=reason).mark,
                              "t") == reason


def test_a_default_runs_save_goes_to_its_own_part_of_the_committed_record(
    tmp_path, monkeypatch):
  # A default run's figures (its files shorter by their skipped scale
  # tests) would make CI's --all pack those files as short: they go to a
  # part of their own, which only a default run reads.
  record = tmp_path / "test_durations.json"
  monkeypatch.setattr(_run_tests, "EXPECTED_PATH", record)
  every = _finished_job(tmp_path, "tests/test_a.py",
                        {"test_a.py": [40, 60], "test_b.py": [3]}, peak=900,
                        threads={"test_a.py": 850, "test_b.py": 20})
  assert _run_tests.record_measured([every], [], path=record) == 2
  default = _finished_job(tmp_path, "tests/test_a.py", {"test_a.py": [40]},
                          peak=900, threads={"test_a.py": 850})
  assert _run_tests.record_measured(
      [default], [], path=record, part=_run_tests.DEFAULT_PART) == 1
  whole = {"test_a.py": (100.0, 850), "test_b.py": (3.0, 20)}
  assert _run_tests.load_measured(record) == whole
  assert _run_tests.load_measured(record, _run_tests.DEFAULT_PART) == {
      "test_a.py": (40.0, 900)}
  # A clean clone (nothing measured of its own): the default run by the
  # default part where it has the file, --all by the whole suite's.
  monkeypatch.setattr(_run_tests, "MEASURED_DIR", tmp_path / "none")
  monkeypatch.setattr(_run_tests, "EXPECTED", whole)
  try:
    _run_tests.use_tier(False)
    assert [_run_tests.expected(tmp_path / n) for n in whole] == [
        (40.0, 900), (3.0, 20)]
  finally:
    _run_tests.use_tier(True)
  assert [_run_tests.expected(tmp_path / n) for n in whole] == [
      (100.0, 850), (3.0, 20)]


def test_a_file_whose_every_test_skipped_keeps_its_earlier_figures(
    tmp_path):
  # test_slurm's tests skip where Slurm is missing (all but CI): such a
  # run's time is not the file's time where it runs. A file whose tests
  # skipped as the scale tier's is the default run's own figure.
  record = tmp_path / "venv.json"
  job = _finished_job(tmp_path, "group 1", {}, peak=900)
  job.xml.write_text(
      "<testsuites><testsuite>"
      '<testcase classname="tests.test_s" name="t0" time="0.1">'
      '<skipped message="no sbatch here"/></testcase>'
      '<testcase classname="tests.test_t" name="t0" time="0.2">'
      '<skipped message="%s: proven by test_u"/></testcase>'
      '<testcase classname="tests.test_u" name="t0" time="2">'
      "</testcase>"
      '<testcase classname="tests.test_u" name="t1" time="0.1">'
      '<skipped message="no sbatch here"/></testcase>'
      "</testsuite></testsuites>" % _run_tests.SCALE_SKIP)
  job.threads_out.write_text(json.dumps(
      {"test_s.py": 10, "test_t.py": 20, "test_u.py": 30}))
  assert job.skipped_whole() == {"test_s.py"}
  assert _run_tests.record_measured([job], [], path=record) == 2
  assert _run_tests.load_measured(record) == {"test_t.py": (0.2, 20),
                                              "test_u.py": (2.1, 30)}


def test_the_default_run_schedules_by_its_own_record_first(tmp_path,
                                                          monkeypatch):
  monkeypatch.setattr(_run_tests, "MEASURED_DIR", tmp_path)
  monkeypatch.setattr(_run_tests, "MEASURED", {})
  every = _finished_job(tmp_path, "tests/test_a.py",
                        {"test_a.py": [40, 60], "test_b.py": [3]}, peak=900,
                        threads={"test_a.py": 850, "test_b.py": 20})
  assert _run_tests.record_measured([every], []) == 2
  default = _finished_job(tmp_path, "tests/test_a.py", {"test_a.py": [40]},
                          peak=900, threads={"test_a.py": 850})
  assert _run_tests.record_measured([default], [], every_tier=False) == 1
  assert _run_tests.measured_path(every_tier=False).name.endswith(
      "-default.json")
  # The default run: its own figure for test_a (its scale tests skipped),
  # the run of every tier's for the file it has not measured.
  _run_tests.use_tier(False)
  assert _run_tests.MEASURED == {"test_a.py": (40.0, 900),
                                 "test_b.py": (3.0, 20)}
  _run_tests.use_tier(True)
  assert _run_tests.MEASURED == {"test_a.py": (100.0, 850),
                                 "test_b.py": (3.0, 20)}


def test_tools_test_passes_all_on_as_the_variable_in_both_its_modes(
    tmp_path):
  _stand_in_tools_test(tmp_path, '"${%s:-unset}|$*"' % support.ALL_TIERS_ENV)
  env = dict(os.environ)
  env.pop(support.ALL_TIERS_ENV, None)
  ran = [subprocess.run([str(tmp_path / "tools" / "test"), *args],
                        env=env, capture_output=True, text=True,
                        timeout=30) for args in (
                            ["--all", "tests/test_x.py", "-q"], ["--all"],
                            ["-v"])]
  assert [(p.returncode, p.stdout) for p in ran] == [
      (0, "1|-m pytest tests/test_x.py -q\n"),
      (0, "1|tools/_run_tests.py\n"),
      (0, "unset|tools/_run_tests.py -v\n")], ran


def test_ci_runs_every_tier_with_the_command_readme_writes():
  # CI runs everything, and README says so with the command CI calls.
  root = support.TOOLS.parent
  assert "./tools/test --all -v -rs" in (root / ".ci" / "run").read_text()
  readme = (root / "README.md").read_text()
  assert "`./tools/test --all`" in readme and "CI" in readme


def test_per_file_adds_up_each_files_tests_classes_included():
  tests = [(2.0, "tests.test_a::test_x"), (3.5, "tests.test_a::test_y"),
           (1.0, "tests.test_b.TestGroup::test_z"),
           (4.0, "tests.test_b::test_w[1]")]
  assert _run_tests.per_file(tests) == [
      (5.5, 2, "test_a.py"), (5.0, 2, "test_b.py")]


def test_a_clean_clone_schedules_by_a_committed_green_runs_record():
  """Issue 29 item 7: what CI's clean clone packs processes by is a green
  run's record (tools/test --save-expected), not a table typed by hand."""
  files = json.loads(_run_tests.EXPECTED_PATH.read_text())["files"]
  assert len(files) >= 30, sorted(files)
  assert all(f["recorded"] and f["threads"] > 0 and f["secs"] >= 0
             for f in files.values()), files
  assert _run_tests.EXPECTED == _run_tests.load_measured(
      _run_tests.EXPECTED_PATH)
  args, rest = _run_tests.parse_args(["--save-expected", "-v"])
  assert args.save_expected and rest == ["-v"]


def test_every_expected_file_exists():
  # A renamed or removed file left in EXPECTED would go unnoticed.
  tests = pathlib.Path(support.TOOLS).parent / "tests"
  default = _run_tests.load_measured(_run_tests.EXPECTED_PATH,
                                     _run_tests.DEFAULT_PART)
  missing = [n for n in [*_run_tests.EXPECTED, *default]
             if not (tests / n).exists()]
  assert not missing, missing


def test_machine_busy_seconds_grow_with_work():
  before = _run_tests.machine_busy_secs()
  assert before is not None and before > 0
  end = time.process_time() + 0.3
  while time.process_time() < end:
    pass
  # This process alone was busy 0.3 s; the clock ticks at 1/100 s.
  assert _run_tests.machine_busy_secs() - before >= 0.25


def test_every_process_draws_ports_from_a_range_of_its_own(tmp_path, expected,
                                                           monkeypatch):
  # CI lost a real-script test when two pytest processes running side by
  # side drew the same free port before either bound it.
  monkeypatch.delenv(_run_tests.PORT_RANGE_ENV, raising=False)
  expected.update({"test_%d.py" % i: (_run_tests.ALONE_SECS + i, 10)
                   for i in range(5)})
  _files(tmp_path, sorted(expected))

  class Args:
    quick = False
    jobs = 4

  monkeypatch.setattr(_run_tests, "TESTS", tmp_path)
  jobs = _run_tests.make_jobs(Args, [], tmp_path)
  ranges = sorted(j.ports for j in jobs)
  assert len(ranges) == 5
  low, high = _run_tests.draw_port_range()
  assert ranges[0][0] >= low and ranges[-1][1] <= high
  # Each range with the next (strict=False: the last has none).
  for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
    assert end <= start  # Disjoint.
  assert all(b - a >= 100 for a, b in ranges)


_MISSING = "sync_replicas_test_no_such_module"


def test_require_returns_the_module_it_imports():
  assert support.require("json", why="unused") is sys.modules["json"]


@pytest.mark.parametrize("value", [None, "", "0"])
def test_require_skips_a_missing_module_outside_tools_test(monkeypatch,
                                                            value):
  if value is None:
    monkeypatch.delenv(support.REQUIRE_TEST_DEPS_ENV, raising=False)
  else:
    monkeypatch.setenv(support.REQUIRE_TEST_DEPS_ENV, value)
  with pytest.raises(pytest.skip.Exception) as skipped:
    support.require(_MISSING, why="the widget test needs it")
  # Allowed at module level, where the three files call it.
  assert skipped.value.allow_module_level
  assert _MISSING in str(skipped.value)
  assert "the widget test needs it" in str(skipped.value)


def test_require_fails_a_missing_module_under_tools_test(monkeypatch):
  monkeypatch.setenv(support.REQUIRE_TEST_DEPS_ENV, "1")
  with pytest.raises(pytest.fail.Exception) as failed:
    support.require(_MISSING, why="the widget test needs it")
  message = str(failed.value)
  assert message.startswith(
      "%s does not import (ModuleNotFoundError: No module named '%s'); the "
      "widget test needs it. setup.cfg's test extra pins it: pip install -e "
      "'.[test]'." % (_MISSING, _MISSING)), message
  assert "SYNC_REPLICAS_REQUIRE_TEST_DEPS=1 (tools/test sets it)" in message


def _stand_in_tools_test(tmp_path, echo):
  """The real tools/test, with stand-ins for tools/_env.sh (which would
  create or check the venv) and for the venv's python (which prints
  ``echo``, a shell word). Returns the copy's path."""
  (tmp_path / "tools").mkdir()
  shutil.copy2(support.TOOLS / "test", tmp_path / "tools" / "test")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (tmp_path / "tools" / "_env.sh").write_text(
      'export PATH=%s:"$PATH"\ncd "$(dirname "${BASH_SOURCE[0]}")/.."\n'
      % bin_dir)
  python = bin_dir / "python"
  python.write_text('#!/bin/sh\necho %s\n' % echo)
  python.chmod(0o755)
  return tmp_path / "tools" / "test"


def test_tools_test_requires_the_test_dependencies_in_both_its_modes(
    tmp_path):
  # The stand-in python says what it was given. A file argument runs
  # pytest directly, anything else tools/_run_tests.py, whose processes
  # inherit the environment.
  _stand_in_tools_test(tmp_path, '"$%s|$*"' % support.REQUIRE_TEST_DEPS_ENV)
  env = dict(os.environ)
  env.pop(support.REQUIRE_TEST_DEPS_ENV, None)
  ran = [subprocess.run([str(tmp_path / "tools" / "test"), *args],
                        env=env, capture_output=True, text=True,
                        timeout=30) for args in (["tests/test_x.py", "-q"],
                                                 ["--quick"])]
  assert [(p.returncode, p.stdout) for p in ran] == [
      (0, "1|-m pytest tests/test_x.py -q\n"),
      (0, "1|tools/_run_tests.py --quick\n")], ran


def test_every_process_hides_sklearn_and_says_why(tmp_path, monkeypatch):
  # Keras 3 imports scikit-learn (and SciPy) with TensorFlow when it can:
  # each process gets a stub first on PYTHONPATH, which children inherit,
  # and whose import fails. The digits' file is still found by metadata.
  monkeypatch.setenv("PYTHONPATH", "/elsewhere")
  # Keras kept: its stub, before this one, is the next test's.
  monkeypatch.setenv(_run_tests.KEEP_KERAS_ENV, "1")
  env = _run_tests.Job("tests/test_x.py", [], [], tmp_path).environment()
  assert _run_tests.HIDDEN == support.HIDDEN
  assert env["PYTHONPATH"].split(os.pathsep) == [str(support.HIDDEN),
                                                 "/elsewhere"]
  code = ("import importlib.metadata\n"
          "try:\n"
          "  import sklearn\n"
          "except ImportError as e:\n"
          "  print(e)\n"
          "else:\n"
          "  raise SystemExit('imported ' + sklearn.__file__)\n"
          "dist = importlib.metadata.distribution('scikit-learn')\n"
          "print(dist.locate_file(%r).is_file())\n"
          % "sklearn/datasets/data/digits.csv.gz")
  proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "sklearn is hidden in the test suite's processes" in proc.stdout
  assert proc.stdout.split()[-1] == "True", proc.stdout
  # A child's PYTHONPATH keeps it; the one test that needs the real
  # scikit-learn takes it off.
  assert support.pythonpath("/root", environ=env).split(os.pathsep) == [
      "/root", str(support.HIDDEN), "/elsewhere"]
  assert support.without_hidden(env)["PYTHONPATH"] == "/elsewhere"


def test_only_the_keras_files_process_keeps_keras_unless_told_otherwise(
    tmp_path, expected, monkeypatch):
  # Two short files marked keras and four others: the marked ones share one
  # process, which alone imports Keras; the others' processes find the stub
  # first. KEEP_KERAS_ENV=1 gives every process Keras, and the plan says so.
  monkeypatch.delenv(_run_tests.KEEP_KERAS_ENV, raising=False)
  monkeypatch.setenv("PYTHONPATH", "/elsewhere")
  expected.update({"test_k1.py": (30, 10), "test_k2.py": (20, 10),
                   "test_a.py": (40, 10), "test_b.py": (35, 10),
                   "test_c.py": (25, 10), "test_d.py": (10, 10)})
  files = _files(tmp_path, sorted(expected))
  for f in files:
    if f.name.startswith("test_k"):
      f.write_text("import pytest\npytestmark = [pytest.mark.quick,\n"
                   "              pytest.mark.keras]\n")
  groups = _run_tests.pack(files, workers=4)
  keeping = [g for g in groups if _run_tests.keeps_keras(g)]
  assert len(groups) == 4, groups
  assert [sorted(f.name for f in g if f.name.startswith("test_k"))
          for g in keeping] == [["test_k1.py", "test_k2.py"]], groups
  jobs = [_run_tests.Job("group %d" % i, g, [], tmp_path)
          for i, g in enumerate(groups)]
  paths = {j.name: j.environment()["PYTHONPATH"].split(os.pathsep)
           for j in jobs}
  for job in jobs:
    assert paths[job.name] == (
        [str(support.HIDDEN), "/elsewhere"] if job.files in keeping else
        [str(support.TASKS_HIDDEN), str(support.HIDDEN), "/elsewhere"])
  assert _run_tests.KERAS_HIDDEN == support.TASKS_HIDDEN
  hidden = next(j for j in jobs if j.files not in keeping)
  proc = subprocess.run([sys.executable, "-c", "import keras"],
                        env=hidden.environment(), cwd=tmp_path,
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode == 1, proc
  assert "keras is hidden" in proc.stderr, proc.stderr
  listing = "\n".join(_run_tests.plan(jobs, 4))
  assert "Keras hidden from 3 of 4 pytest processes" in listing, listing
  assert _run_tests.KEEP_KERAS_ENV + "=1" in listing, listing
  monkeypatch.setenv(_run_tests.KEEP_KERAS_ENV, "1")
  assert [j.environment()["PYTHONPATH"] for j in jobs] == [
      os.pathsep.join([str(support.HIDDEN), "/elsewhere"])] * 4
  assert "Keras hidden from 0 of 4" in _run_tests.keras_line(jobs)


def test_tools_test_hides_sklearn_when_it_runs_files_itself(tmp_path,
                                                            monkeypatch):
  # Named files run in one pytest process, not through _run_tests.py: the
  # same stub comes first on PYTHONPATH there too.
  test = _stand_in_tools_test(tmp_path, '"$PYTHONPATH"')
  monkeypatch.setenv("PYTHONPATH", "/elsewhere")
  proc = subprocess.run([str(test), "tests/test_x.py"], capture_output=True,
                        text=True, timeout=30, check=False)
  assert (proc.returncode, proc.stdout.strip().split(os.pathsep)) == (
      0, [str(tmp_path / "tests" / "_hidden"), "/elsewhere"]), proc


def test_require_names_the_install_it_is_given(monkeypatch):
  """test_keras's tf_keras is not in the test extra: its own advice."""
  monkeypatch.setenv(support.REQUIRE_TEST_DEPS_ENV, "1")
  with pytest.raises(pytest.fail.Exception) as failed:
    support.require(_MISSING, why="the widget test needs it",
                    install="the widget extra pins it: pip install widget")
  assert ("the widget test needs it. the widget extra pins it: pip install "
          "widget." in str(failed.value)), str(failed.value)
  assert "'.[test]'" not in str(failed.value)


def test_a_file_that_does_not_import_fails_without_stopping_the_others(
    tmp_path):
  """A module-level ``support.require`` failure is a collection error."""
  broken = tmp_path / "test_broken.py"
  broken.write_text("import %s\n" % _MISSING)
  fine = tmp_path / "test_fine.py"
  fine.write_text("def test_fine():\n  pass\n")
  alone = tmp_path / "test_alone.py"
  alone.write_text("def test_alone():\n  pass\n")
  args = ["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
  jobs = [_run_tests.Job("shared", [broken, fine], args, tmp_path),
          _run_tests.Job("alone", [alone], args, tmp_path)]
  done = _run_tests.run(jobs, workers=1, stop_early=False)
  assert [(job.name, job.rc) for job in done] == [("shared", 1),
                                                  ("alone", 0)]
  ran = [test for _, test in jobs[0].test_times()]
  assert any(test.endswith("test_fine") for test in ran), ran


class _FakeRunner:
  """A thread named as stock's queue runner, whose runs are Python stand-ins
  for ``Session._call_tf_sessionrun``: the first lasts ``first_run_secs``
  (the last update's run, caught in its tail), the next blocks until
  ``release`` (the run that waits in take_grad)."""

  def __init__(self, first_run_secs):
    self.release = threading.Event()
    self.second_run_started = threading.Event()
    self._first_run_secs = first_run_secs
    self.thread = threading.Thread(
        target=self._run, name="QueueRunnerThread-sync_token_q-fake",
        daemon=True)

  def _run(self):
    first_run_secs = self._first_run_secs

    def _call_tf_sessionrun(secs):  # pylint: disable=invalid-name
      if secs is None:
        self.second_run_started.set()
        self.release.wait(30)
      else:
        self.release.wait(secs)

    _call_tf_sessionrun(first_run_secs)
    _call_tf_sessionrun(None)

  def __enter__(self):
    self.thread.start()
    support.wait_until(
        lambda: support._session_run_frame(self.thread) is not None,  # pylint: disable=protected-access
        timeout=10, what="the fake runner's first run")
    return self

  def __exit__(self, *exc):
    self.release.set()
    self.thread.join(10)
    assert not self.thread.is_alive()


def test_stock_runner_wait_skips_the_run_it_first_sees_when_that_ends():
  """CI once saw the last update's run in its tail and took it for the
  blocked one: the stop was then seen before the next run."""
  with _FakeRunner(first_run_secs=0.3) as runner:
    support.wait_for_stock_runner_to_block([runner.thread])
    assert runner.second_run_started.is_set()


def test_stock_runner_wait_takes_a_run_that_outlasts_the_settle_time():
  with _FakeRunner(first_run_secs=60) as runner:
    start = time.monotonic()
    support.wait_for_stock_runner_to_block([runner.thread])
    waited = time.monotonic() - start
    assert not runner.second_run_started.is_set()
    assert waited >= support.RUN_SETTLED_SECS - 0.05, waited


def test_stock_runner_wait_fails_naming_what_it_waited_for():
  idle = threading.Thread(target=time.sleep, args=(3,),
                          name="QueueRunnerThread-sync_token_q-idle",
                          daemon=True)
  idle.start()
  with pytest.raises(AssertionError, match="stock's queue runner"):
    support.wait_for_stock_runner_to_block([idle], timeout=0.2)
  idle.join(10)


def test_held_in_turns_stops_at_once_lets_go_between_turns_and_resumes():
  sent = []
  with support.held_in_turns(sent.append, hold_secs=0.1, release_secs=0.05):
    assert sent == [signal.SIGSTOP]  # Stopped before the block runs.
    # Three turns, however long a loaded machine takes to give them.
    support.wait_until(lambda: sent.count(signal.SIGSTOP) >= 3, timeout=30,
                       what="three turns of held_in_turns")
  assert sent[-1] == signal.SIGCONT
  # Strict turns before the closing resume (sent whatever the last turn).
  turns = sent[:-1]
  # Each signal with the next (strict=False: the last has none).
  assert all(a != b for a, b in zip(turns, turns[1:], strict=False)), sent
  assert sent.count(signal.SIGSTOP) >= 3, sent


def _sleeper_with_a_child(**popen_kwargs):
  """A python that starts a sleeping child, prints its pid and sleeps."""
  code = ("import subprocess, sys, time\n"
          "child = subprocess.Popen(['sleep', '300'])\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(300)\n")
  proc = subprocess.Popen([sys.executable, "-c", code], text=True,
                          stdout=subprocess.PIPE, **popen_kwargs)
  return proc, int(proc.stdout.readline())


def test_kill_group_kills_the_process_and_its_children():
  proc, child = _sleeper_with_a_child(start_new_session=True)
  support.kill_group(proc, timeout=30)
  assert proc.returncode == -signal.SIGKILL
  # A killed child of a killed parent is reaped by init; until then it is
  # a zombie, which pid_runs counts as gone.
  support.wait_until(lambda: not support.pid_runs(child), timeout=30,
                     what="the group's child to die with it")


def test_kill_group_names_a_process_that_leads_no_group():
  """CI once waited 30 s on such a process: killpg found no group by its
  pid, so nothing was killed and the wait's timeout hid the test's own
  failure. Now the process itself dies and the misuse is named."""
  proc, child = _sleeper_with_a_child()
  try:
    with pytest.raises(AssertionError, match="start_new_session=True"):
      support.kill_group(proc, timeout=30)
    assert proc.returncode == -signal.SIGKILL
  finally:
    os.kill(child, signal.SIGKILL)
    if proc.returncode is None:
      proc.kill()
      proc.wait(30)


def test_a_failed_tests_tmp_path_is_kept_and_named(tmp_path, monkeypatch):
  import conftest  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv(conftest.KEEP_ENV, str(tmp_path / "kept"))
  work = tmp_path / "work"
  (work / "job").mkdir(parents=True)
  (work / "job" / "worker0.log").write_text(
      "\n".join("line %d" % i for i in range(40)))
  keep = conftest._keep  # pylint: disable=protected-access
  text = keep(work, "tests/test_x.py::test_y[a b]")
  kept = tmp_path / "kept" / "tests_test_x.py_test_y_a_b_"
  assert (kept / "job" / "worker0.log").read_text().endswith("line 39")
  assert str(kept) in text.splitlines()[0]
  assert "line 39" in text and "line 27" not in text  # The log's last lines.
  assert _run_tests.kept_report(tmp_path / "kept") == [
      "Failed tests' tmp_path (their task logs), kept under %s:"
      % (tmp_path / "kept"), "  " + kept.name]
  assert not _run_tests.kept_report(tmp_path / "none")


def _finished_job(tmp_path, name, files, *, rc=0, peak=0, threads=None):
  """A Job as run() leaves it: its JUnit file and thread counts written."""
  job = _run_tests.Job(name, [tmp_path / f for f in files], [], tmp_path)
  cases = "".join(
      '<testcase classname="tests.%s" name="t%d" time="%s"/>'
      % (f[:-3], i, secs) for f, times in files.items()
      for i, secs in enumerate(times))
  job.xml.write_text("<testsuites><testsuite>%s</testsuite></testsuites>"
                     % cases)
  if threads is not None:
    job.threads_out.write_text(json.dumps(threads))
  job.rc, job.peak_threads = rc, peak
  return job


def test_a_green_run_records_what_it_measured_for_the_next(tmp_path, expected,
                                                           monkeypatch):
  record = tmp_path / "record" / "venv.json"
  alone = _finished_job(tmp_path, "tests/test_a.py", {"test_a.py": [2, 3]},
                        peak=900, threads={"test_a.py": 850})
  shared = _finished_job(tmp_path, "group 1",
                         {"test_b.py": [1], "test_c.py": [0.5, 0.5]},
                         peak=1500, threads={"test_b.py": 700,
                                             "test_c.py": 300})
  assert _run_tests.record_measured([alone, shared], ["-v", "-rs"],
                                    path=record) == 3
  measured = _run_tests.load_measured(record)
  # The file alone: at least its process's peak; sharing: its own threads.
  assert measured == {"test_a.py": (5.0, 900), "test_b.py": (1.0, 700),
                      "test_c.py": (1.0, 300)}
  # The next run packs by them, not by the hand-written table.
  expected.update({"test_a.py": (1, 10)})
  monkeypatch.setattr(_run_tests, "MEASURED", measured)
  assert _run_tests.expected(tmp_path / "test_a.py") == (5.0, 900)
  # A later green run of one file updates that file only.
  again = _finished_job(tmp_path, "tests/test_b.py", {"test_b.py": [4]},
                        peak=720, threads={"test_b.py": 710})
  assert _run_tests.record_measured([again], [], path=record) == 1
  assert _run_tests.load_measured(record) == dict(
      measured, **{"test_b.py": (4.0, 720)})


def test_a_loaded_runs_times_are_recorded_as_the_machines_own(tmp_path):
  # Others' load stretched the run: the machine was busy three times the
  # CPU of the run's own processes, so each file's wall time is stored as a
  # third, the time the schedule would see with the machine to itself, and
  # the wall time measured beside it.
  record = tmp_path / "venv.json"
  job = _finished_job(tmp_path, "tests/test_a.py", {"test_a.py": [60, 30]},
                      peak=900, threads={"test_a.py": 850})
  job.cpu_secs = 40.0
  stretch = _run_tests.load_stretch([job], busy=120.0)
  assert stretch == 3.0
  assert _run_tests.record_measured([job], [], path=record,
                                    stretch=stretch) == 1
  assert _run_tests.load_measured(record) == {"test_a.py": (30.0, 900)}
  entry = json.loads(record.read_text())["files"]["test_a.py"]
  assert (entry["wall"], entry["stretch"]) == (90.0, 3.0)
  # A machine the run had to itself (or unknown) stretches nothing: busy
  # less than the run's own CPU (children it did not reap) counts as 1.
  assert _run_tests.load_stretch([job], busy=35.0) == 1.0
  assert _run_tests.load_stretch([job], busy=None) == 1.0
  job.cpu_secs = 0.0
  assert _run_tests.load_stretch([job], busy=120.0) == 1.0


@pytest.mark.parametrize("args, rc", [(["-k", "parity"], 0), ([], 1),
                                      (["--maxfail=1"], 0)],
                         ids=["selected", "failed", "maxfail"])
def test_only_a_green_run_of_whole_files_is_recorded(tmp_path, args, rc):
  record = tmp_path / "venv.json"
  job = _finished_job(tmp_path, "tests/test_a.py", {"test_a.py": [2]},
                      rc=rc, peak=900, threads={"test_a.py": 850})
  assert _run_tests.record_measured([job], args, path=record) == 0
  assert not record.exists()


def test_a_failed_process_keeps_its_files_earlier_figures(tmp_path):
  # A green process measured its files whole; a failed one's are not
  # recorded (a test that failed early makes its file look short).
  record = tmp_path / "venv.json"
  green = _finished_job(tmp_path, "tests/test_a.py", {"test_a.py": [2, 3]},
                        peak=900, threads={"test_a.py": 850})
  green.cpu_out.write_text(json.dumps({"tests/test_a.py::t0": 1.5,
                                       "tests/test_a.py::t1": 2.0}))
  failed = _finished_job(tmp_path, "tests/test_b.py", {"test_b.py": [1]},
                         rc=1, peak=700, threads={"test_b.py": 690})
  assert _run_tests.record_measured([green, failed], [], path=record) == 1
  assert _run_tests.load_measured(record) == {"test_a.py": (5.0, 900)}
  assert json.loads(record.read_text())["files"]["test_a.py"]["cpu"] == 3.5


def test_every_knockout_patch_still_applies(capsys):
  # tools/knockout removes one feature at a time by a text replacement; a
  # change that moves that text would leave its row failing as an error
  # (the full run is too long for the suite: docs/testing.md).
  knockout = support.load_tool("knockout")
  assert knockout.main(["--check"]) == 0, capsys.readouterr().err
  named = {t.split("::")[0] for row in knockout.TABLE for t in row.tests}
  assert not [n for n in named if not (support.TOOLS.parent / "tests" / n)
              .exists()], named


def test_under_load_runs_the_command_while_a_hog_spins(tmp_path):
  # tools/under_load is how docs/testing.md's loaded runs were made: its
  # claim is that the hog really took CPU while each run ran, and that a
  # failed run is counted and its output kept.
  status = tmp_path / "status"

  def under_load(times, exit_status, logs):
    # The command sleeps a little and exits with ``exit_status``.
    status.write_text(str(exit_status))
    return subprocess.run(
        [sys.executable, str(support.TOOLS / "under_load"), "--times",
         str(times), "--logs", str(tmp_path / logs), "--", sys.executable,
         "-c", "import sys, time; time.sleep(1.5); "
         "sys.exit(int(open(sys.argv[1]).read()))", str(status)],
        capture_output=True, text=True, timeout=120, check=False)

  proc = under_load(2, 0, "ok")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  runs = [l for l in proc.stdout.splitlines() if l.startswith("run ")]
  assert len(runs) == 2 and "0 of 2 run(s) failed" in proc.stdout
  # The hog's share depends on what else runs (0.05 cores beside a whole
  # suite, near 1 on a quiet machine), but a runnable process gets some
  # CPU within 1.5 s under Linux's fair scheduler; with no hog it is 0.00.
  used = [float(l.split("hog used ")[1].split()[0]) for l in runs]
  assert min(used) > 0, proc.stdout
  proc = under_load(1, 3, "bad")
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "run 1: exit 3" in proc.stdout and "1 of 1 run(s) failed" in \
      proc.stdout
  assert (tmp_path / "bad" / "run-1.log").exists()


def test_a_relative_venv_is_put_on_path_absolute(tmp_path):
  # CI passes SYNC_REPLICAS_VENV=.venv-215. On PATH as given, it made the
  # tests' sys.executable relative, and test_confine's child, started as
  # another user elsewhere, could not find it. A stand-in venv whose stamp
  # says it is installed, so that _env.sh installs nothing.
  root = support.TOOLS.parent
  venv = tmp_path / "venv"
  (venv / "bin").mkdir(parents=True)
  (venv / "bin" / "python").symlink_to(sys.executable)
  sums = "|".join(
      subprocess.run(["cksum"], input=path.read_bytes(), capture_output=True,
                     check=True).stdout.decode().strip()
      for path in (root / "setup.cfg", support.TOOLS / "_env.sh"))
  (venv / ".sync_replicas-installed").write_text(
      "tf-stand-in|test,examples|%s\n" % sums)
  env = dict(os.environ, SYNC_REPLICAS_VENV=os.path.relpath(venv, root),
             SYNC_REPLICAS_TF="tf-stand-in")
  out = subprocess.run(
      ["bash", "-c", "source tools/_env.sh && command -v python"], cwd=root,
      env=env, capture_output=True, text=True, timeout=60, check=False)
  assert out.returncode == 0, out.stderr
  found = out.stdout.strip()
  assert os.path.isabs(found), found
  assert os.path.normpath(found) == str(venv / "bin" / "python"), found


#: A stand-in venv's python for tools/_env.sh: pip installs nothing but
#: notes each call; the TensorFlow version query answers 2.21.
_FAKE_PYTHON = """#!/bin/bash
case "$1 $2" in
  "-m pip") echo "$*" >> "$(dirname "$0")/../pip-calls"; exit 0 ;;
  "-c "*) echo 2.21; exit 0 ;;
esac
exit 1
"""


def test_the_demo_and_the_tests_share_one_venv_state(tmp_path):
  # Issue 46: the first ./tools/check after ./tools/demo reinstalled the
  # venv (the demo had installed another set of extras). A copy of the
  # tools with a stand-in venv and a stand-in demo run: the demo installs
  # once; what tools/check and tools/test source then installs nothing.
  root = tmp_path / "clone"
  (root / "tools").mkdir(parents=True)
  for name in ("_env.sh", "demo"):
    shutil.copy2(support.TOOLS / name, root / "tools" / name)
  shutil.copy2(support.TOOLS.parent / "setup.cfg", root / "setup.cfg")
  (root / "tools" / "_demo").write_text("#!/bin/bash\necho demo ran\n")
  (root / "tools" / "_demo").chmod(0o755)
  venv = tmp_path / "venv"
  (venv / "bin").mkdir(parents=True)
  (venv / "bin" / "python").write_text(_FAKE_PYTHON)
  (venv / "bin" / "python").chmod(0o755)
  env = dict(os.environ, SYNC_REPLICAS_VENV=str(venv))
  env.pop("SYNC_REPLICAS_TF", None)
  demo = subprocess.run([str(root / "tools" / "demo")], cwd=root, env=env,
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert demo.returncode == 0 and "demo ran" in demo.stdout, demo
  assert "tools: installing" in demo.stderr, demo.stderr
  installs = (venv / "pip-calls").read_text().splitlines()
  assert any("-e %s[test,examples]" % root in c for c in installs), installs
  # setuptools' editable-install notice and the rest of pip's output go to
  # the log, not to the terminal.
  assert "pip-calls" not in demo.stderr
  assert (venv / ".sync_replicas-install.log").exists()
  tools = subprocess.run(["bash", "-c", "source tools/_env.sh"], cwd=root,
                         env=env, capture_output=True, text=True, timeout=60,
                         check=False)
  assert tools.returncode == 0, tools.stderr
  assert "installing" not in tools.stderr, tools.stderr
  assert (venv / "pip-calls").read_text().splitlines() == installs


@pytest.mark.parametrize("error", [
    tf.errors.CancelledError(None, None, "Step was cancelled by an explicit "
                             "call to `Session::Close()`."),
    tf.errors.FailedPreconditionError(None, None, "Session is closed."),
], ids=["cancelled", "session_closed"])
def test_stocks_runner_thread_may_die_of_its_sessions_close(error):
  """Both deaths a close gives stock's runner thread, depending on whether
  it caught the thread inside a run or between two (CI saw the second):
  this test fails under the suite's thread-death rule unless conftest's hook
  lets them pass."""
  def die():
    raise error

  thread = threading.Thread(target=die, daemon=True,
                            name="QueueRunnerThread-sync_token_q-closed")
  thread.start()
  thread.join(10)
  assert not thread.is_alive()


def test_tools_test_help_is_its_own_and_starts_nothing(tmp_path):
  # Four helpers ran ./tools/test --help and got the suite's runner starting
  # every file with pytest's --help. The real script runs here, from a copy
  # without the venv or the runner beside it: its help must come before it
  # needs either.
  (tmp_path / "tools").mkdir()
  script = tmp_path / "tools" / "test"
  shutil.copy(support.TOOLS / "test", script)
  for args in (["--help"], ["-x", "-h"]):
    proc = subprocess.run([str(script), *args], capture_output=True,
                          text=True, timeout=10)
    assert proc.returncode == 0, proc
    assert "--all       every tier" in proc.stdout, proc.stdout
    assert "--save-expected" in proc.stdout, proc.stdout
    assert proc.stdout.startswith("Runs the test suite"), proc.stdout
    assert "source " not in proc.stdout and proc.stderr == "", proc
    assert not (tmp_path / ".venv").exists()


def test_quick_runs_and_plans_at_most_two_processes_at_a_time():
  # --quick packs its short files for two processes; its plan said "at most
  # 4 at a time" (--jobs' default) while the run started two.
  for argv, expected in [(["--quick"], 2), (["--quick", "--jobs", "1"], 1),
                         ([], 4), (["--jobs", "6"], 6), (["--jobs", "0"], 1)]:
    args, _ = _run_tests.parse_args(argv)
    assert _run_tests.workers(args) == expected, argv


def test_a_finished_process_says_when_it_ran_in_the_run(tmp_path, capsys):
  # Where a schedule idled (a long process started late, a tail of one)
  # shows in the headers: each says its span from the run's start.
  job = _run_tests.Job("group 3", [], [], tmp_path)
  job.log.write_text("its output\n")
  job.rc, job.start, job.end = 0, 1000.0, 1121.4
  _run_tests.report(job, 2, 14, began=900.0)
  out = capsys.readouterr().out
  assert "[2/14] group 3: exit 0 in 121 s (from 100 to 221 s of the run)\n" in (
      out), out
  assert out.endswith("its output\n"), out

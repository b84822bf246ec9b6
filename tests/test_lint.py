"""The linter over the checkout, as tests.

The suite itself fails on a finding, with the finding in the message. The
rules live in pyproject.toml, each with its reason.
"""

import pathlib
import subprocess
import sys

import pytest

import support

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: ruff takes a second; one that runs past this hangs.
CHECKER_TIMEOUT_SECS = 240
_WHY = "tests/test_lint.py runs it over the checkout"


def _run_checker(*args):
  """Runs ``python -m <args>`` in the checkout; returns (exit code, output)."""
  support.require(args[0], why=_WHY)
  try:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=CHECKER_TIMEOUT_SECS)
  except subprocess.TimeoutExpired as e:
    pytest.fail("%s ran past %d s; its output so far:\n%s"
                % (" ".join(args), CHECKER_TIMEOUT_SECS, e.output or ""))
  return proc.returncode, proc.stdout


def test_ruff_finds_nothing():
  rc, out = _run_checker("ruff", "check", "--output-format", "concise")
  assert rc == 0, (
      "ruff found what pyproject.toml's [tool.ruff] rules forbid:\n%s\n"
      "Fix each finding (`ruff check` in the venv shows them again); a rule "
      "that does not fit the house is turned off in pyproject.toml with its "
      "reason, not silenced line by line." % out)


def test_ruff_reads_every_python_program_in_tools():
  rc, out = _run_checker("ruff", "check", "--show-files")
  assert rc == 0, out
  # --show-files prints absolute paths; a program found by its shebang.
  listed = {pathlib.Path(line.strip()).resolve()
            for line in out.splitlines() if line.strip()}
  programs = [path for path in sorted((ROOT / "tools").iterdir())
              if path.is_file() and path.suffix != ".py"
              and path.read_bytes().startswith(b"#!/usr/bin/env python")]
  assert programs, "no Python program found in tools/: is ROOT right?"
  missing = [str(p.relative_to(ROOT)) for p in programs if p not in listed]
  assert not missing, (
      "ruff does not read %s: a Python program without a .py name must be "
      "listed in pyproject.toml's [tool.ruff] extend-include" % missing)

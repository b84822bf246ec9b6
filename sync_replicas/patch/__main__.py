"""The patch runner: ``python -m sync_replicas.patch SCRIPT [ARGS...]``.

Owns running an unmodified program the way ``python`` would, with the patch
installed as soon as the program imports TensorFlow: ``sys.argv``,
``sys.path[0]``, ``__name__ == "__main__"``, exit codes, signals and
uncaught exceptions (the program's own traceback, without this runner's
frames) are what ``python SCRIPT`` or ``python -m MODULE`` gives. The
installed command ``sync-replicas-run`` is the same runner.
"""

import atexit
import importlib.util
import logging
import os
import runpy
import signal
import sys
import typing

import sync_replicas
from sync_replicas import patch
from sync_replicas.cli import _cli

#: The installed command; ``python -m sync_replicas.patch`` is the same.
PROG = "sync-replicas-run"

USAGE = """\
usage: %(prog)s [--help] [--version] [--list] SCRIPT [ARGS...]
       %(prog)s [--list] -m MODULE [ARGS...]
   or: python -m sync_replicas.patch ... (the same)
"""

# The options and an example come first, the details after them, as in the
# other tools' help (sync_replicas/cli/_cli.py).
HELP = USAGE + """
Runs a TensorFlow 1.x-style training program unchanged, with
sync_replicas.SyncReplicasOptimizer wherever the program reaches stock's
SyncReplicasOptimizer.

options:
  -h, --help  show this message and exit
  --version   print sync_replicas' version and exit
  --list      print the modules patched (imports TensorFlow), then run the
              program if one is given
  -m MODULE   run library module MODULE as a script, like `python -m`

example:
  %(prog)s train.py --job_name=worker --task_index=0
  python -m sync_replicas.patch -m my_project.train --ps_hosts=127.0.0.1:2222

The program runs in this process as `python SCRIPT [ARGS...]` (or `python
-m MODULE [ARGS...]`) would run it: same sys.argv, sys.path[0], __name__ ==
"__main__", exit code, signals and tracebacks (Ctrl-C included: the
program's KeyboardInterrupt, as under python, not this runner's). Errors of
the runner's own arguments are one line and exit code 2.

%(scope)s"""

EXIT_USAGE = _cli.EXIT_USAGE


class _Usage(Exception):
  """Bad arguments to the runner itself (not to the program)."""


def _parse(argv):
  """Splits ``argv`` into the runner's options and the program's command.

  The first word that is not one of ours is the program; everything after
  it is the program's own, dashes included.

  Returns:
    ``(options, kind, target, args)``: a set of option names, "script",
    "module" or None, the script path or module name, the program's args.
  """
  options = set()
  words = list(argv)
  while words:
    word = words.pop(0)
    if word in ("-h", "--help", "--version", "--list"):
      options.add(word.lstrip("-")[:1] if word == "-h" else word.lstrip("-"))
    elif word == "-m":
      if not words:
        raise _Usage("-m needs a module name: -m MODULE [ARGS...]")
      return options, "module", words[0], words[1:]
    elif word.startswith("-m") and len(word) > 2:
      return options, "module", word[2:], words
    elif word == "--":
      if not words:
        raise _Usage("expected a script after --")
      return options, "script", words[0], words[1:]
    elif word.startswith("-") and word != "-":
      raise _Usage("unknown option %r (the program's own options go after "
                   "SCRIPT or -m MODULE)" % word)
    else:
      return options, "script", word, words
  return options, None, None, []


def _usage_error(message):
  """One line on stderr, as every tool of the package; exit code 2."""
  sys.stderr.write("%s: error: %s (see %s --help)\n" % (PROG, message, PROG))
  return EXIT_USAGE


def _program_frames(tb):
  """``tb`` without its leading frames of this runner and of runpy."""
  skip = (os.path.abspath(__file__), runpy.__file__, "<frozen runpy>")
  while tb is not None and tb.tb_frame.f_code.co_filename in skip:
    tb = tb.tb_next
  return tb


class _Interrupted:
  """Ends the process by SIGINT after exit handlers, as Python does.

  An uncaught KeyboardInterrupt makes Python print the traceback, run its
  exit handlers and kill itself with SIGINT (so the parent sees -2 / 130).
  This handler is registered before the program's, so it runs after them.
  """

  def __init__(self):
    self.caught = False
    atexit.register(self._resend)

  def _resend(self):
    if self.caught:
      sys.stdout.flush()
      sys.stderr.flush()
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      os.kill(os.getpid(), signal.SIGINT)


def _show_the_patch():
  """The patch's lines go to stderr, as this tool's: the program's own
  logging, whatever it is, does not decide whether the swap is seen."""
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter(PROG + ": %(message)s"))
  patch.logger.addHandler(handler)
  patch.logger.setLevel(logging.INFO)
  patch.logger.propagate = False


def _run(kind, target, args):
  """Runs the program as ``__main__``; returns only if it returned."""
  _show_the_patch()
  if kind == "script":
    if not os.path.exists(target):
      return _usage_error("can't open file %r: [Errno 2] No such file or "
                          "directory" % os.path.abspath(target))
    sys.argv = [target] + args
    # `python SCRIPT` puts the script's directory (links resolved) first.
    sys.path[0] = os.path.dirname(os.path.realpath(target))
    patch.install_when_tensorflow_is_imported()
    runpy.run_path(target, run_name="__main__")
    return 0
  sys.path[0] = os.getcwd()  # `python -m` puts the working directory first.
  try:
    found = importlib.util.find_spec(target)
  except (ImportError, ValueError) as e:
    found, reason = None, e
  else:
    reason = "No module named %r" % target
  if found is None:
    return _usage_error(reason)
  sys.argv = [target] + args  # runpy puts the module's path in argv[0].
  patch.install_when_tensorflow_is_imported()
  runpy.run_module(target, run_name="__main__", alter_sys=True)
  return 0


def main(argv: "typing.Sequence[str] | None" = None) -> int:
  """The runner's entry point (also the ``sync-replicas-run`` command)."""
  argv = sys.argv[1:] if argv is None else argv
  try:
    options, kind, target, args = _parse(argv)
  except _Usage as e:
    return _usage_error(e)
  if "h" in options or "help" in options:
    sys.stdout.write(HELP % {"prog": PROG, "scope": patch.SCOPE})
    return 0
  if "version" in options:
    sys.stdout.write("%s (sync_replicas) %s\n"
                     % (PROG, sync_replicas.__version__))
    return 0
  if "list" in options:
    with patch.install():
      sys.stdout.write("".join("%s.SyncReplicasOptimizer\n" % name
                               for name in patch.replaced()))
    if kind is None:
      return 0
  if kind is None:
    return _usage_error("expected SCRIPT or -m MODULE")
  interrupted = _Interrupted()
  try:
    return _run(kind, target, args)
  except SystemExit:
    raise
  except BaseException as e:  # pylint: disable=broad-except
    # What Python does with an uncaught exception, minus our frames.
    interrupted.caught = isinstance(e, KeyboardInterrupt)
    # Python's own display reads the exception's __traceback__, so the
    # trimmed one is set on it too.
    tb = _program_frames(e.__traceback__)
    sys.excepthook(type(e), e.with_traceback(tb), tb)
    return 1


if __name__ == "__main__":
  sys.exit(main())

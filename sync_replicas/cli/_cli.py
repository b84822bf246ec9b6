"""What every command-line tool of the package shares.

Owns the tools' exit codes (0 done, 1 could not do it, 2 bad usage, 130
interrupted), their argument parser (``--help`` from the module docstring,
options first after its examples,
``--version``, a usage error as one line), the check of a ``host:port``
argument, and ``run``, which ends a tool on Ctrl-C with exit code 130 and no
traceback.

Standard library only: the launcher imports it and must start without
TensorFlow (whose import starts threads, and a process with threads cannot be
confined; see ``_confine``).
"""

import argparse
import os
import signal
import sys
import threading

from sync_replicas import __version__

EXIT_OK = 0
#: The tool could not do what was asked (the reason is on stderr).
EXIT_FAILED = 1
#: Bad arguments: nothing was done.
EXIT_USAGE = 2
#: Ctrl-C (SIGINT), as a shell reports a command it interrupted.
EXIT_INTERRUPTED = 130


class _Formatter(argparse.RawDescriptionHelpFormatter,
                 argparse.ArgumentDefaultsHelpFormatter):
  """The docstring as written (its examples keep their lines), defaults.

  Each default once: a help text that says its default in words keeps them
  alone, and an option without a value to show (None, False, "") gets no
  "(default: None)".
  """

  def _get_help_string(self, action):
    text = action.help or ""
    nothing = (action.default is None or action.default is False
               or action.default == "")  # Not `in`: 0 == False, worth showing.
    if "default" in text or nothing:
      return text
    return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose usage errors are one line and exit code 2."""

  def error(self, message):
    self.exit(EXIT_USAGE, "%s: error: %s (see %s --help)\n"
              % (self.prog, message, self.prog))


def parser(prog, doc, **kwargs):
  """A ``Parser`` for the tool ``prog`` documented by ``doc``.

  Args:
    prog: The installed name, e.g. ``"sync-replicas-status"``: help and
      errors show it however the tool was started (console script,
      ``python -m``, or a wrapper in tools/).
    doc: The tool module's docstring, shown whole by ``--help``: its
      summary and examples before the options, the rest after them.
    **kwargs: More ``argparse.ArgumentParser`` arguments.

  Returns:
    The parser, with ``--version`` added.
  """
  description, epilog = help_parts(doc)
  result = Parser(prog=prog, description=description, epilog=epilog,
                  formatter_class=_Formatter, **kwargs)
  result.add_argument("--version", action="version",
                      version="%(prog)s (sync_replicas) " + __version__)
  return result


def add_command(parser):
  """Adds the positional ``command``: the program to run, after ``--``."""
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="the program every task runs, after --")


def command_given(parser, args):
  """``args.command`` without its leading ``--``; a usage error if empty."""
  if args.command and args.command[0] == "--":
    args.command = args.command[1:]
  if not args.command:
    parser.error("give the program to run after --, e.g. "
                 "-- python -m examples.digits")
  return args.command


def help_parts(doc):
  """``(description, epilog)`` of ``--help`` from a tool's docstring.

  The summary and the usage examples that follow it come before the
  options; the rest of the prose after them, where it no longer hides them
  (a user once scrolled past 45 lines to reach them). RST's double
  backticks, which the docstrings use for names, are dropped: a terminal
  shows them as they are.
  """
  paragraphs = doc.replace("``", "").strip().split("\n\n")
  head = 1
  while head < len(paragraphs) and paragraphs[head].startswith("  "):
    head += 1  # An example: indented command lines.
  return ("\n\n".join(paragraphs[:head]),
          "\n\n".join(paragraphs[head:]) or None)


def address(text):
  """``text`` if it is ``host:port`` with a port in 1..65535.

  For ``type=`` of an argparse argument, whose error then names the
  argument. A leading ``grpc://`` is accepted.

  Raises:
    argparse.ArgumentTypeError: If ``text`` is no such address.
  """
  bare = text[len("grpc://"):] if text.startswith("grpc://") else text
  host, _, port = bare.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise argparse.ArgumentTypeError("expected host:port with a port in 1..65535, got %r"
                     % text)
  return text


def addresses(text):
  """A comma-separated list of ``address``es (empty: none), as a list."""
  return [address(a) for a in text.split(",") if a]


def say(prog, message):
  """Writes ``prog: message`` to stderr: a tool's one line of failure."""
  sys.stderr.write("%s: %s\n" % (prog, message))
  sys.stderr.flush()


def run(main, argv, *, prog, exit_at_once=False):
  """``main(argv)``'s exit code; 130 on Ctrl-C, with one line, no traceback.

  Args:
    main: The tool's body: takes ``argv``, returns the exit code.
    argv: Its arguments (None: the command line's).
    prog: The tool's name, in front of the line saying it was interrupted.
    exit_at_once: Ctrl-C ends the process on the spot instead of raising
      KeyboardInterrupt, for a tool with nothing to clean up that waits
      inside TensorFlow: a KeyboardInterrupt raised during a session run
      comes out as a RuntimeError traceback ("MISMATCH of original and
      normalized active exception types", pybind11, TensorFlow 2.21).
      Otherwise the tool's own clean-up (the launcher stopping its tasks)
      runs in its ``finally`` blocks before the interrupt reaches here.

  Returns:
    The exit code.
  """
  if threading.current_thread() is not threading.main_thread():
    return _run(main, argv, prog)  # Signals reach the main thread only.
  # Set explicitly: a shell starts a background job with SIGINT ignored, and
  # Python then installs no handler of its own; Ctrl-C (or kill -INT from a
  # script) must still end the tool.
  handler, undo = signal.default_int_handler, lambda: None
  if exit_at_once:
    handler = lambda *_: _exit_interrupted(prog)
    undo = _exit_on_wakeup(prog)
  previous = signal.signal(signal.SIGINT, handler)
  try:
    return _run(main, argv, prog)
  finally:
    # As before: a test calls main in its own process.
    signal.signal(signal.SIGINT, previous)
    undo()


def _run(main, argv, prog):
  try:
    return main(argv)
  except KeyboardInterrupt:
    say(prog, "interrupted")
    return EXIT_INTERRUPTED


def _exit_on_wakeup(prog):
  """Exits on SIGINT even while the main thread waits inside C++.

  Python runs a signal's handler in the main thread once it is back in
  Python; a session run waiting on an address that never answers is not,
  for up to its timeout. Python's C-level handler also writes the signal's
  number to the wakeup fd at once: a thread of ours waits on it.

  Returns:
    A function that undoes it: the previous wakeup fd back, our thread
    ended.
  """
  read_end, write_end = os.pipe()
  os.set_blocking(write_end, False)
  previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

  def wait():
    with open(read_end, "rb", buffering=0) as signals:
      for number in iter(lambda: signals.read(1), b""):  # b"": undone.
        if number == bytes([signal.SIGINT]):
          _exit_interrupted(prog)

  waiter = threading.Thread(target=wait, name="exit-on-ctrl-c", daemon=True)
  waiter.start()

  def undo():
    signal.set_wakeup_fd(previous)
    os.close(write_end)
    waiter.join(timeout=5)

  return undo


#: Held by whichever of the two ways a Ctrl-C arrives (the handler in the
#: main thread, the wakeup thread) gets there first: one line, one exit.
_EXITING = threading.Lock()


def _exit_interrupted(prog):
  if not _EXITING.acquire(blocking=False):
    return  # The other one is exiting.
  sys.stdout.flush()
  say(prog, "interrupted")
  os._exit(EXIT_INTERRUPTED)  # pylint: disable=protected-access

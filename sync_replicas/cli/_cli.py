"""What every command-line tool of the package shares.

Owns the tools' exit codes (0 done, 1 could not do it, 2 bad usage, 130
interrupted), their argument parser (``--help`` from the module docstring,
``--version``, a usage error as one line), the check of a ``host:port``
argument, and ``run``, which ends a tool on Ctrl-C with exit code 130 and no
traceback.

Standard library only: the launcher imports it and must start without
TensorFlow (whose import starts threads, and a process with threads cannot be
confined; see ``_confine``).
"""

import argparse
import sys

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
  """The docstring as written (its examples keep their lines), defaults."""


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
    doc: The tool module's docstring, shown whole by ``--help``.
    **kwargs: More ``argparse.ArgumentParser`` arguments.

  Returns:
    The parser, with ``--version`` added.
  """
  result = Parser(prog=prog, description=doc, formatter_class=_Formatter,
                  **kwargs)
  result.add_argument("--version", action="version",
                      version="%(prog)s (sync_replicas) " + __version__)
  return result


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


def run(main, argv, *, prog):
  """``main(argv)``'s exit code; 130 on Ctrl-C, with one line, no traceback.

  A tool's own clean-up (the launcher stopping its tasks) runs before the
  interrupt reaches here, in its ``finally`` blocks.
  """
  try:
    return main(argv)
  except KeyboardInterrupt:
    say(prog, "interrupted")
    return EXIT_INTERRUPTED

"""Saved runs read back: the runs.jsonl files tools/bench and tools/linkcost write.

Owns what a tool's ``--render`` does before its table: which options go with
``--render`` (``render_only``), reading each file as lines of JSON objects,
each line checked by the tool's own ``check`` (``read``), and the rules any
merge of several files keeps: a file given once, and a name standing for one
build wherever it appears (a column of the table, or a model's row). Every
failure is one ``RunsFileError`` line: what was expected, what arrived (the
file and its line), and how to fix it. No process, no TensorFlow; import it
with tools/ on ``sys.path``, as ``bench_report`` does.

What a cell of a report pairs (bench pairs one repetition's interleaved
runs, linkcost takes medians over any) is the tool's: each checks it on
``read``'s rows.
"""

import json
import pathlib
import typing


class RunsFileError(ValueError):
  """Saved runs that cannot be read back, or not merged into one report."""


class Kind(typing.NamedTuple):
  """What one tool's runs.jsonl is.

  Fields:
    tool: The tool, as a user types it (``tools/bench``).
    example: Where it writes runs.jsonl by default (``runs/bench/runs.jsonl``).
    check: ``check(row, where)`` raises ``RunsFileError`` unless ``row`` (a
      JSON object) is a run as the tool writes it; ``where`` is "FILE line N".
    builds: ``builds(row)``: ``[(name, field)]``, the fields of ``row`` that
      say how the thing ``name`` stands for was built (an implementation's
      options): one name, one value, in every file of one report.
  """

  tool: str
  example: str
  check: typing.Callable[[dict, str], None]
  builds: typing.Callable[[dict], list]


def render_only(parser, args, *, keep=()):
  """``parser.error`` (exit 2) when ``args`` of a ``--render`` also set an
  option that only a run reads (any not in ``keep``)."""
  defaults = vars(parser.parse_args([]))
  given = ["--" + name.replace("_", "-") for name, value in vars(args).items()
           if name != "render" and name not in keep
           and value != defaults[name]]
  if given:
    parser.error("--render prints the report of saved runs and runs "
                 "nothing, so %s would do nothing: drop %s" % (
                     " and ".join(given),
                     "it" if len(given) == 1 else "them"))


def read(paths, kind):
  """The rows of every file in ``paths``, checked.

  Returns:
    ``[(path, [(line number, row)])]``, in the order given.

  Raises:
    RunsFileError: A file is missing, a folder, not text, empty, given
      twice, or holds a line that is not a run of ``kind.tool``; or one name
      stands for two builds (``kind.builds``).
  """
  files, builds = [], {}  # (name, field): (value, where).
  for path in map(pathlib.Path, paths):
    if any(path == given for given, _ in files):
      raise RunsFileError("%s is given twice: give each file once" % path)
    rows = _read_file(path, kind)
    for number, row in rows:
      where = "%s line %d" % (path, number)
      for name, field in kind.builds(row):
        value, first = builds.setdefault((name, field), (row[field], where))
        if value != row[field]:
          raise RunsFileError(
              "%r has %s %s at %s but %s at %s: its rows of the report "
              "would mix two builds; render them apart (a file each), or "
              "drop one build's lines" % (
                  name, field, json.dumps(value, sort_keys=True), first,
                  json.dumps(row[field], sort_keys=True), where))
    files.append((path, rows))
  return files


def _read_file(path, kind):
  """``[(line number, row)]`` of one file, each row checked."""
  form = "one JSON object a line, as %s writes it into its --out folder" % (
      kind.tool)
  if path.is_dir():
    raise RunsFileError("%s is a folder: give the runs.jsonl in it (%s)" % (
        path, path / "runs.jsonl"))
  try:
    text = path.read_text()
  except FileNotFoundError:
    raise RunsFileError(
        "no such file: %s (%s writes runs.jsonl into its --out folder, e.g. "
        "%s)" % (path, kind.tool, kind.example)) from None
  except UnicodeDecodeError:
    raise RunsFileError("%s is not text, so not a runs.jsonl (%s)" % (
        path, form)) from None
  except OSError as e:
    raise RunsFileError("cannot read %s: %s" % (path, e.strerror)) from None
  rows = []
  for number, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    where = "%s line %d" % (path, number)
    try:
      row = json.loads(line)
    except ValueError as e:
      raise RunsFileError(
          "%s is not JSON (%s): a runs.jsonl holds %s; a line cut short is "
          "a run that was being written: drop it" % (where, e, form)) from None
    if not isinstance(row, dict):
      raise RunsFileError("%s is a JSON %s, not an object: a runs.jsonl "
                          "holds %s" % (where, type(row).__name__, form))
    kind.check(row, where)
    rows.append((number, row))
  if not rows:
    raise RunsFileError(
        "%s holds no runs (%s stopped before its first run leaves it "
        "so): give a runs.jsonl with runs in it" % (path, kind.tool))
  return rows


def check_fields(row, where, fields, *, tool):
  """``RunsFileError`` for the first of ``fields`` that ``row`` does not
  hold as ``tool`` writes it.

  Args:
    row: One line's object, every key of ``fields`` in it.
    where: "FILE line N".
    fields: ``[(ok, field, expected)]``: whether the field is right, its
      name, and what the tool writes there.
    tool: As ``Kind.tool``.
  """
  for ok, field, expected in fields:
    if not ok:
      raise RunsFileError(
          "%s has %s %s, where %s writes %s: the line was edited, or another "
          "tool or version wrote it; give a runs.jsonl as this version of "
          "%s writes it" % (where, field, json.dumps(row[field])[:200], tool,
                            expected, tool))


def is_number(value):
  """An int or float, not a bool (JSON's true is no count)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_count(value, least):
  """An int (not a bool) of at least ``least``."""
  return isinstance(value, int) and not isinstance(value, bool) and (
      value >= least)

"""Where the tasks of a Slurm job step run, from the step's environment.

Owns parsing Slurm's compressed host lists (``node[01-03,07],login1``) and
tasks-per-node counts (``2(x3),1``), and the step's layout: every task as
a (node, local id) pair, in the order in which ``sync-replicas-slurm`` gives
them their TensorFlow roles, and which of them this process is.

The order does not depend on how Slurm distributed the tasks (block,
cyclic, plane, arbitrary): each task knows its node's index in the step's
node list (``SLURM_NODEID``) and its place on that node
(``SLURM_LOCALID``), and the step's node list and per-node counts are the
same in every task. The roles go to local id 0 of every node first, then
local id 1, and so on, nodes in list order: the ps tasks, which come first,
land on different nodes while there are nodes left (a ps task's link sets
the pace of an update), and every task computes the whole layout alone,
without reading Slurm's task-to-node mapping, which only some distributions
make computable from the environment. ``SLURM_PROCID`` is not used for the
roles.

Standard library only (see ``_cli``).
"""

import collections
import re

#: The variables a task of an ``srun`` step has, and what each is for.
REQUIRED = {
    "SLURM_JOB_ID": "the job",
    "SLURM_STEP_ID": "the step",
    "SLURM_NODEID": "this task's node, as an index in the step's node list",
    "SLURM_LOCALID": "this task's place on its node",
    "SLURM_STEP_NUM_TASKS": "how many tasks the step has",
}
#: The step's node list and tasks per node, each with the job's variable as
#: a fallback (older Slurm releases set only those).
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")

Slot = collections.namedtuple("Slot", ["node", "local_id"])
Slot.__doc__ = "One task of the step: its node's name and its local id there."


class SlurmEnvError(ValueError):
  """The environment is not a Slurm step's, or is inconsistent."""


def expand_hostlist(text):
  """The host names of a Slurm host list, in its order.

  ``"node[01-03,07],login1"`` gives ``node01 node02 node03 node07 login1``;
  several bracket groups in one name expand as Slurm does, the last one
  fastest (``r[1-2]n[1-2]``: ``r1n1 r1n2 r2n1 r2n2``); zero padding follows
  the range's first bound.

  Raises:
    SlurmEnvError: For unbalanced brackets, an empty name or a bad range.
  """
  hosts = []
  for item in _split_top_level(text.strip(), text):
    if not item:
      raise SlurmEnvError("empty host name in Slurm host list %r" % text)
    names = [""]
    for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
      if not literal and ranges == "":
        continue
      suffixes = _expand_ranges(ranges, text) if ranges else [""]
      names = [n + literal + s for n in names for s in suffixes]
    hosts.extend(names)
  return hosts


def _split_top_level(text, whole):
  """``text`` split at the commas outside brackets."""
  parts, depth, current = [], 0, []
  for char in text:
    if char == "[":
      depth += 1
      if depth > 1:
        raise SlurmEnvError("nested brackets in Slurm host list %r" % whole)
    elif char == "]":
      depth -= 1
      if depth < 0:
        raise SlurmEnvError("unbalanced ']' in Slurm host list %r" % whole)
    if char == "," and depth == 0:
      parts.append("".join(current))
      current = []
    else:
      current.append(char)
  if depth:
    raise SlurmEnvError("unbalanced '[' in Slurm host list %r" % whole)
  parts.append("".join(current))
  return parts


def _expand_ranges(ranges, whole):
  out = []
  for part in ranges.split(","):
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
    if not match:
      raise SlurmEnvError("bad range %r in Slurm host list %r: expected N or "
                          "N-M" % (part, whole))
    low, high = match.group(1), match.group(2) or match.group(1)
    if int(high) < int(low):
      raise SlurmEnvError("descending range %r in Slurm host list %r"
                          % (part, whole))
    out.extend(str(i).zfill(len(low)) for i in range(int(low), int(high) + 1))
  return out


def expand_tasks_per_node(text):
  """Tasks on each node: ``"2(x3),1"`` gives ``[2, 2, 2, 1]``.

  Raises:
    SlurmEnvError: For anything else than ``N`` and ``N(xR)`` items.
  """
  counts = []
  for item in text.strip().split(","):
    match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
    if not match:
      raise SlurmEnvError("bad item %r in Slurm tasks per node %r: expected "
                          "N or N(xR)" % (item, text))
    counts.extend([int(match.group(1))] * int(match.group(2) or 1))
  return counts


def layout(nodes, counts):
  """The step's slots in role order: local id 0 of each node, then 1, ...

  Raises:
    SlurmEnvError: If there are not as many counts as nodes.
  """
  if len(nodes) != len(counts):
    raise SlurmEnvError(
        "the step's node list has %d nodes (%s) but its tasks per node give "
        "%d counts (%s)" % (len(nodes), ",".join(nodes), len(counts),
                            ",".join(map(str, counts))))
  return [Slot(node, local) for local in range(max(counts, default=0))
          for node, count in zip(nodes, counts, strict=True) if local < count]


Step = collections.namedtuple("Step", [
    "job_id", "step_id", "slots", "me", "procid"])
Step.__doc__ = """This task's step: ``slots`` in role order, ``me`` this
task's index in it, ``procid`` its SLURM_PROCID (for messages only)."""


def read_step(environ):
  """This task's ``Step`` from a Slurm task's environment.

  Raises:
    SlurmEnvError: Saying which variable is missing or wrong and how to run
      under Slurm instead.
  """
  missing = [name for name in REQUIRED if not environ.get(name)]
  nodelist = _first(environ, NODELIST_VARS)
  per_node = _first(environ, TASKS_PER_NODE_VARS)
  if nodelist is None:
    missing.append(NODELIST_VARS[0])
  if per_node is None:
    missing.append(TASKS_PER_NODE_VARS[0])
  if missing:
    raise SlurmEnvError(
        "not a task of a Slurm job step: %s unset. Start it with srun inside "
        "an allocation, e.g. 'srun -n 4 sync-replicas-slurm --ps 1 -- python "
        "train.py' in an sbatch script or under salloc" % ", ".join(missing))
  try:
    node_id, local_id = (int(environ["SLURM_NODEID"]),
                         int(environ["SLURM_LOCALID"]))
    num_tasks = int(environ["SLURM_STEP_NUM_TASKS"])
  except ValueError as e:
    raise SlurmEnvError("a Slurm task id is not a number: %s" % e) from None
  nodes = expand_hostlist(nodelist)
  slots = layout(nodes, expand_tasks_per_node(per_node))
  if len(slots) != num_tasks:
    raise SlurmEnvError(
        "the step's tasks per node (%s) add up to %d tasks, but "
        "SLURM_STEP_NUM_TASKS is %d" % (per_node, len(slots), num_tasks))
  if not 0 <= node_id < len(nodes):
    raise SlurmEnvError("SLURM_NODEID %d is outside the step's node list %s"
                        % (node_id, nodelist))
  mine = Slot(nodes[node_id], local_id)
  if mine not in slots:
    raise SlurmEnvError("SLURM_LOCALID %d is beyond the %s tasks on node %s"
                        % (local_id, per_node, mine.node))
  here = environ.get("SLURMD_NODENAME")
  if here and here != mine.node:
    raise SlurmEnvError(
        "SLURMD_NODENAME is %s but node %d of the step's node list %s is %s"
        % (here, node_id, nodelist, mine.node))
  return Step(job_id=environ["SLURM_JOB_ID"], step_id=environ["SLURM_STEP_ID"],
              slots=slots, me=slots.index(mine),
              procid=environ.get("SLURM_PROCID", "?"))


def _first(environ, names):
  for name in names:
    if environ.get(name):
      return environ[name]
  return None

"""How the package's lines name a task: ``chief0``, ``worker1``, ``ps0``.

Owns the one form every line uses for a task: its job and index run
together, as the launcher labels its lines (``[worker1]``), as TF_CONFIG
and the device (``/job:worker/task:1``) say, and as the examples, the
status tool and the timeline print it. Without a ``chief`` job, worker 0 is
the chief and is named ``worker0``.

A worker's *key* is its index among the replicas in the records on the ps
(the done record, the local steps): with a ``chief`` job, key 0 is
``chief0`` and key N is ``worker<N-1>``; without one, key N is ``workerN``.
Lines name the task; a key appears only where no task is known (an
unplaced, in-process job), as ``key N``. Imports no TensorFlow: the
timeline tool uses it too.
"""

import re

_TASK = re.compile(r"/job:([\w-]+)/(?:replica:\d+/)?task:(\d+)")


def name(job, index):
  """``worker1`` for job ``worker``, index 1."""
  return "%s%d" % (job, int(index))


def of_device(device):
  """``worker1`` for ``/job:worker/replica:0/task:1``; None if ``device``
  names no task."""
  found = _TASK.search(device or "")
  return name(found.group(1), found.group(2)) if found else None


def of_key(key, devices):
  """The name of worker ``key``, ``devices`` ``{key: task device}``
  (``_lost.key_devices``); ``key N`` where no task is known."""
  return of_device(devices.get(key) if devices else None) or "key %d" % key


def listed(keys, devices):
  """``chief0, worker1``: the names of ``keys``, in key order."""
  return ", ".join(of_key(k, devices) for k in sorted(keys))


def of_file_name(task):
  """The name of a task from a timeline file's name: ``worker1`` as
  written now, and ``worker-1`` as earlier releases wrote it."""
  found = re.fullmatch(r"([\w-]+?)-(\d+)", task)
  return name(found.group(1), found.group(2)) if found else task

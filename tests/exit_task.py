"""README's program (tests/lost_task.py) for tests/test_exit_codes.py,
which resumes a SIGSTOPped task as this one's interpreter exits.

``python tests/exit_task.py SPEC_JSON``: lost_task.py's task, with the
spec's ``resume_file`` read at exit: if the test wrote a process group id
there (the task it stopped), that group gets SIGCONT. The handler is
registered before sync_replicas is imported, so it runs after every
handler of the package (atexit runs them last first): the stopped task
answers only once the package's own exit work is done, the moment a read
left waiting on it would come back from TensorFlow while the interpreter
finalizes (seen by chance as an abort, exit 134, in a suite run).
"""

import atexit
import json
import os
import signal
import sys


def _resume(path):
  try:
    with open(path) as f:
      group = int(f.read())
  except (OSError, ValueError):  # Nothing stopped, or not yet written.
    return
  try:
    os.killpg(group, signal.SIGCONT)
  except ProcessLookupError:
    pass


atexit.register(_resume, json.loads(sys.argv[1])["resume_file"])

import lost_task  # pylint: disable=g-import-not-at-top,wrong-import-position

if __name__ == "__main__":
  sys.exit(lost_task.main(sys.argv))

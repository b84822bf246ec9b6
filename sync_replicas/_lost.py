"""Which workers a waiting update lacks, and whether their tasks still answer.

Owns the chief's look at the workers behind a stall (issue 44): from the
state on the ps (each worker's key, its recorded address and local step, the
workers done) and a bounded probe of each worker's task, the clause that
names every worker that cannot push (task, address, and why: its task
refuses connections, does not answer, or answers but does not push).

The probe has two stages, each bounded: a TCP connection to the task's
address (refused: nothing listens there, the task is down; no answer: the
host or the link is gone), then, where it connects, a read of the task's
own local step (``_diagnose.LocalStepReader``): a process that is stopped
(SIGSTOP) or hung still gets its connections from the kernel, but its
server answers nothing.
"""

import errno
import socket

from sync_replicas import _compat
from sync_replicas import _diagnose

#: Bound on the TCP probe of one task, in seconds.
CONNECT_TIMEOUT_SECS = 2.0

REFUSED = "its task refuses connections (down)"
NO_ANSWER = ("its task does not answer (stopped or hung, or its host or "
             "link is down)")
SILENT = ("its task accepts connections but does not answer (stopped or "
          "hung)")


def probe_address(address, *, timeout_secs=CONNECT_TIMEOUT_SECS):
  """None if a TCP connection to ``address`` (``host:port``) opens, else
  why not (``REFUSED``, ``NO_ANSWER``, or what the resolver said)."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)),
                                  timeout=timeout_secs):
      return None
  except ConnectionRefusedError:
    return REFUSED
  except (socket.timeout, TimeoutError):
    return NO_ANSWER
  except socket.gaierror as e:
    return "its address %s does not resolve (%s)" % (address, e)
  except (OSError, ValueError) as e:
    if getattr(e, "errno", None) in (errno.EHOSTUNREACH, errno.ENETUNREACH):
      return NO_ANSWER
    return "its address %s cannot be reached (%s)" % (address, e)


def key_devices(local_step_device, total_num_replicas):
  """``{key: task device}``: the task of each worker key (``_data_end``'s
  keys are task indices, the chief first in a ``chief`` job's layout)."""
  devices = _diagnose.manifest_devices(local_step_device, total_num_replicas)
  return dict(enumerate(devices))


def lacking(*, keys, addresses, devices, read_steps,
            probe=probe_address):
  """``[(key, device, address, reason)]`` of the workers in ``keys`` that
  cannot push, in key order.

  Args:
    keys: The keys of the workers the update may wait for (not done).
    addresses: ``{key: "host:port"}`` recorded on the ps.
    devices: ``{key: task device}``.
    read_steps: Reads the local step of a list of task devices, bounded
      (``LocalStepReader.read`` with its target bound); a reading whose step
      is None did not answer.
    probe: ``probe_address`` (for tests).
  """
  found, to_read = {}, []
  for key in sorted(keys):
    address = addresses.get(key)
    reason = probe(address) if address else None
    if reason is not None:
      found[key] = reason
    elif key in devices:
      to_read.append(key)
  if to_read:
    for key, reading in zip(to_read, read_steps([devices[k] for k in to_read]),
                            strict=True):
      if reading.step is None and reading.error != "not started":
        found[key] = SILENT if addresses.get(key) else (
            "its task does not answer (%s)" % reading.error)
  return [(key, devices.get(key), addresses.get(key), found[key])
          for key in sorted(found)]


def clause(lost, *, missing):
  """The stall line's part naming the workers that cannot push ("; ..."),
  "" if none.

  Args:
    lost: ``lacking``'s result.
    missing: Gradients the update still lacks (at least the fewest of any
      accumulator).
  """
  if not lost:
    return ""
  named = ["worker key %d (%s%s): %s" % (
      key, device or "task unknown", " at %s" % address if address else "",
      reason) for key, device, address, reason in lost]
  return ("; the update lacks %d gradient(s); %d worker(s) cannot push: %s"
          % (missing, len(lost), "; ".join(named)))


def stall_clause(sess, *, ends, done, counts, needed, reader):
  """The chief's clause for a stall line, "" where it cannot tell.

  Args:
    sess: The chief's session (a remote master's: in process no task is
      probed).
    ends: The ``_data_end.DataEnd`` (None without a policy: no record).
    done: The keys of the workers done (``_data_end.read_done``).
    counts: The accumulators' fresh gradient counts.
    needed: Gradients the update needs.
    reader: The runner's ``_diagnose.LocalStepReader`` (None without a
      local step).
  """
  if ends is None or done is None or reader is None or not sess.sess_str:
    return ""
  missing = needed - min(counts, default=needed)
  if missing <= 0:
    return ""
  total = ends.total_num_replicas
  config = _compat.session_config(sess)
  lost = lacking(
      keys=set(range(total)) - set(done),
      addresses=ends.local_steps.read_addresses(sess),
      devices=key_devices(reader.spec.device, total),
      read_steps=lambda devices: reader.read(sess.sess_str, devices,
                                             config=config))
  return clause(lost, missing=missing)

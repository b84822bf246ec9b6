"""tools/profile_messages: what one message costs a ps, in CPU.

The tool runs once at a small size on a real two-process cluster (a ps
child and this test's worker): every probe must run to its end (the queue
ping-pong's two threads included), and the figures must say what they
measure. A large tensor's bytes cost the ps CPU a no-op RunGraph does not
have, and a run costs more than none: a tool that measured nothing would
read the same for both.
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROBES = ["idle", "rungraph", "fetch_4", "fetch_big", "push_4", "push_big",
          "queue_ready", "queue_blocked"]


def test_profile_messages_prices_a_rungraph_a_tensor_and_bytes(tmp_path):
  out = tmp_path / "messages.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "profile_messages"),
       "--reps", "1", "--runs", "200", "--k", "4", "--json", str(out),
       "--budget", "200"],
      capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(out.read_text())
  ps = {name: runs[0] for name, runs in result["ps_ms_per_run"].items()}
  assert sorted(ps) == sorted(PROBES), ps
  # /proc's clock ticks are 10 ms: 200 runs resolve 0.05 ms per run. A
  # no-op RunGraph costs the ps 0.3-0.4 ms here, 1.1 MB in 0.7-1.1 ms more.
  assert ps["idle"] < ps["rungraph"], ps
  assert ps["push_big"] > ps["rungraph"] + 0.2, ps
  assert ps["fetch_big"] > ps["rungraph"], ps
  worker = result["worker_ms_per_run"]
  assert worker["rungraph"][0] > worker["idle"][0], worker
  assert "a RunGraph (no tensor)" in proc.stdout

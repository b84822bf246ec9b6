"""tools/linkcost: tools/bench's runs with every task on its own shaped host.

One real run at its smallest (a ps and two workers, each on an emulated host
of its own, the links shaped slow enough to be the bottleneck) checks that
the byte counters are the links' own: the ps's link carries what the graph
says a step moves (two pushes and two reads of the one variable), and the
shaped link caps the updates at what its rate allows; MWMS's run after it
moves the ring's bytes, with the ps pool's processes gone before its own
start (one pool alive at a time: two W = 16 pools do not fit in memory
beside other work). The cost model and the table are checked on known
numbers.
"""

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest

import support

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The flat model: one variable of 20,000 float32.
FLAT_BYTES = 20_000 * 4


@pytest.mark.scale(reason=(
    "tools/linkcost end to end on emulated hosts (ours and MWMS): its "
    "floors, ratios and tables are proven on made-up samples by this "
    "file's other tests, and the hosts' link shaping by test_hosts"))
@pytest.mark.skipif(
    not support.is_machine_root(),
    reason="emulated hosts need the machine's root here: /run/netns is "
    "mounted over in the tool's own mount namespace")
def test_link_counters_measure_what_the_graph_moves(tmp_path):
  out = tmp_path / "linkcost"
  # 20 Mbit/s: 2.5 MB/s on the ps's link, 160 kB a step each way (W * S),
  # at most about 16 updates/s: the link, not the CPU, sets the pace.
  proc = subprocess.Popen(
      [sys.executable, str(ROOT / "tools" / "linkcost"), "--scenarios",
       "flat", "--workers", "2", "--ps", "1", "--impls", "ours,mwms",
       "--variant", 'fused={"fuse_dense_gradients": true}', "--reps", "1",
       "--secs", "2", "--link-rate", "20mbit", "--out", str(out)],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pools = _PoolWatch(proc.pid)
  try:
    output, _ = proc.communicate(timeout=300)
  finally:
    proc.kill()
    pools.stop()
  assert proc.returncode == 0, output[-6000:]
  # Both pools ran, never together: the ps pool's tasks were gone before
  # MWMS's first task started.
  assert {"ps", "mwms"} <= set().union(*pools.seen), pools.seen
  assert {"ps", "mwms"} not in pools.seen, pools.seen
  runs = [json.loads(line)
          for line in (out / "runs.jsonl").read_text().splitlines()]
  assert [r["impl"] for r in runs] == ["ours", "fused", "mwms"]
  ring, = [r for r in runs if r["impl"] == "mwms"]
  assert sorted(ring["links"]) == ["worker0", "worker1"], ring
  # Two workers' ring: each sends its half of the model's gradient and
  # receives the other's, then the same again for the gathered halves:
  # 2 (W-1)/W * S = S each way.
  assert ring["floor_bytes"] == FLAT_BYTES
  for way in ("sent", "received"):
    for worker in ("worker0", "worker1"):
      assert 1.0 <= ring["links"][worker][way] / FLAT_BYTES < 1.3, ring
  for run in runs[:2]:
    links = run["links"]
    assert sorted(links) == ["ps0", "worker0", "worker1"], run
    assert sorted(run["drops"]) == sorted(links), run
    # What the graph moves: each worker pushes the variable's gradient and
    # reads the variable once a step; the ps's link carries both workers'.
    assert run["model_bytes"] == FLAT_BYTES
    assert run["floor_bytes"] == 2 * FLAT_BYTES
    assert run["busiest"] == "ps0", links
    for way in ("sent", "received"):
      # Counted, and near the graph's size: gRPC's and TCP's framing and
      # the token, step and ack messages add a few percent, not a copy.
      assert 1.0 <= links["ps0"][way] / (2 * FLAT_BYTES) < 1.3, links
      for worker in ("worker0", "worker1"):
        assert 1.0 <= links[worker][way] / FLAT_BYTES < 1.3, links
    # The shaping holds: no more bytes a second than the rate lets through.
    ceiling = run["link_bits"] / 8 / run["floor_bytes"]
    assert run["updates_per_s"] <= 1.1 * ceiling, run
  table = (out / "table.md").read_text()
  assert "| flat | 20mbit | 2 | 1 | ours |" in table, table


class _PoolWatch:
  """Which pools' task processes, among ``pid``'s descendants, were alive
  together: every 0.05 s, the set of kinds seen ("ps": tools/_bench_task.py,
  "mwms": tools/_bench_peer_task.py)."""

  KINDS = {"_bench_task.py": "ps", "_bench_peer_task.py": "mwms"}

  def __init__(self, pid):
    self._pid = pid
    self.seen = set()
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def _alive(self):
    parents, commands = {}, {}
    for entry in os.listdir("/proc"):
      if not entry.isdigit():
        continue
      try:
        with open("/proc/%s/stat" % entry) as f:
          # The parent's pid follows the command's closing parenthesis.
          parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
        with open("/proc/%s/cmdline" % entry, "rb") as f:
          commands[int(entry)] = f.read().split(b"\0")
      except (OSError, ValueError, IndexError):
        continue  # Gone since listed.
    family, grew = {self._pid}, True
    while grew:
      more = {p for p, parent in parents.items() if parent in family}
      grew = not more <= family
      family |= more
    kinds = set()
    for pid in family:
      for word in commands.get(pid, []):
        kind = self.KINDS.get(os.path.basename(word.decode(errors="replace")))
        if kind:
          kinds.add(kind)
    return frozenset(kinds)

  def _loop(self):
    while not self._done.wait(0.05):
      self.seen.add(self._alive())

  def stop(self):
    self._done.set()
    self._thread.join(timeout=10)


def test_pools_take_turns_mwms_last_then_first():
  linkcost = support.load_tool("linkcost")
  impls = ["stock", "ours", "mwms", "fastest"]
  # The ps designs rotate; MWMS closes an even repetition and opens the
  # next, so the runs switch pools once a repetition (A B B A).
  assert linkcost.run_order(impls, 0) == ["stock", "ours", "fastest", "mwms"]
  assert linkcost.run_order(impls, 1) == ["mwms", "ours", "fastest", "stock"]
  assert linkcost.run_order(impls, 2) == ["fastest", "stock", "ours", "mwms"]
  assert linkcost.run_order(["ours", "fused"], 1) == ["fused", "ours"]


def test_floors_are_the_busiest_ps_share_or_the_ring_s_two_passes():
  linkcost = support.load_tool("linkcost")
  chief = {"model_bytes": 1000, "ps_shard_bytes": {"ps0": 700, "ps1": 300}}
  # A ps design: W pushes and W reads of the busiest task's share, one
  # way each, and both in turn.
  assert linkcost.floors("stock", 4, chief, {}) == (4 * 700, 8 * 700)
  # 16-bit pushes alone leave the float32 reads the larger way...
  assert linkcost.floors("ours", 4, chief, {"transfer_dtype": "bfloat16"}) \
      == (4 * 700, 6 * 700)
  # ...and with packed reads both ways are halved.
  assert linkcost.floors(
      "ours", 4, chief, {"transfer_dtype": "bfloat16",
                         "pack_variable_reads": True}) == (2 * 700, 4 * 700)
  # Prefetched reads are packed reads (the option implies them).
  assert linkcost.floors(
      "ours", 4, chief, {"transfer_dtype": "bfloat16",
                         "prefetch_variable_reads": True}) \
      == (2 * 700, 4 * 700)
  # More ps tasks than workers, the variables split: W * S_p = 500 < S,
  # and a worker's link, which carries the whole model, is the busiest.
  spread = {"model_bytes": 1000,
            "ps_shard_bytes": {"ps%d" % i: 250 for i in range(4)}}
  assert linkcost.floors("ours", 2, spread, {}) == (1000, 2000)
  assert linkcost.floors("ours", 8, spread, {}) == (2000, 4000)
  # Ring all-reduce: 2 (W-1)/W of the model on every worker's link, sent
  # and received at once.
  assert linkcost.floors("mwms", 4, {"model_bytes": 1000}, {}) == (1500, 1500)
  assert linkcost.floors("ours", 4, {}, {}) == (None, None)


def test_job_cores_are_the_job_s_cpu_over_the_chief_s_stepping_time():
  linkcost = support.load_tool("linkcost")
  # 16 workers joined late: the chief's first steps are 10 s apart, the
  # measured window holds one update in 2.5 s, and the job used 6 CPU-s
  # over the 12.5 s from the chief's first step to its last.
  chief = {"steps_at": [(100.0, 1), (110.0, 2), (112.5, 3)],
           "job_cpu_secs": 6.0}
  assert linkcost.job_cores(chief) == pytest.approx(6.0 / 12.5)
  # The window's rate (1 update in 2.5 s) over updates per CPU-second over
  # the span (2 / 6.0) would say 1.2 cores.
  assert linkcost.job_cores({"steps_at": [(1.0, 1)],
                             "job_cpu_secs": 6.0}) is None
  assert linkcost.job_cores({"steps_at": chief["steps_at"]}) is None


def test_counters_are_read_at_the_window_s_ends_between_samples():
  linkcost = support.load_tool("linkcost")
  counters = linkcost.Counters(["host0"])
  counters.samples = [(10.0, {"host0": (0, 100)}),
                      (11.0, {"host0": (1000, 300)})]
  assert counters.at(10.25) == {"host0": (250.0, 150.0)}
  assert counters.at(12.0) == {"host0": (1000.0, 300.0)}


def test_table_gives_medians_ratios_to_mwms_and_the_ceilings():
  linkcost = support.load_tool("linkcost")

  def row(impl, ups, busiest_bytes, rep=0):
    return {"scenario": "mlp", "link_rate": "8mbit", "link_bits": 8e6,
            "workers": 2, "ps": 1, "impl": impl, "rep": rep, "options": {},
            "updates_per_s": ups, "busiest": "ps0",
            "busiest_bytes": busiest_bytes, "model_bytes": 100_000,
            "ps_shard_bytes": {"ps0": 100_000}, "job_cores": 0.5,
            "drops": {"ps0": 3, "worker0": 1}}

  text = linkcost.table([row("ours", 2.0, 250_000),
                         row("ours", 4.0, 250_000, rep=1),
                         row("mwms", 2.0, 200_000)])
  lines = text.splitlines()
  # 1 MB/s links; ours' floor is 200 kB each way, 400 kB in turn: at most
  # 5.0 and 2.5 updates/s; its median 3.0, 1.2 of the latter.
  assert ("| mlp | 8mbit | 2 | 1 | ours | 2 | 3.00 | 1.50 | ps0 | 0.250 | "
          "0.200 | 1.25 | 5.0 / 2.5 | 1.20 | 75% | 0.50 | 4 |") in lines, text
  # The ring: 2 (W-1)/W * S = 100 kB both ways at once.
  assert ("| mlp | 8mbit | 2 | - | mwms | 1 | 2.00 | - | ps0 | 0.200 | "
          "0.100 | 2.00 | 10.0 / 10.0 | 0.20 | 40% | 0.50 | 4 |") in lines, text


def test_compact_table_puts_a_cell_s_implementations_side_by_side():
  linkcost = support.load_tool("linkcost")

  def row(impl, ups, busiest_bytes, options=None, rep=0):
    return {"scenario": "mlp", "link_rate": "8mbit", "link_bits": 8e6,
            "workers": 2, "ps": 1, "impl": impl, "rep": rep,
            "options": options or {}, "updates_per_s": ups,
            "busiest": "ps0", "busiest_bytes": busiest_bytes,
            "model_bytes": 100_000, "ps_shard_bytes": {"ps0": 100_000}}

  half = {"transfer_dtype": "bfloat16", "pack_variable_reads": True}
  text = linkcost.compact([row("mwms", 5.0, 100_000),
                           row("fastest", 4.0, 110_000, half),
                           row("ours", 2.0, 210_000),
                           row("ours", 3.0, 230_000, rep=1),
                           row("stock", 2.0, 220_000)])
  lines = text.splitlines()
  # Stock, ours, the variant, MWMS, on 1 MB/s links. In turn, ours moves
  # 2 * W * S = 400 kB an update: at most 2.5 updates/s, its median 2.5 is
  # 1.00 of it; fastest's halves move 200 kB (4.0 of 5.0); the ring's
  # 100 kB each way at once (5.0 of 10.0).
  assert lines[0].startswith(
      "| model | link | W | P | reps | stock | ours | fastest | mwms | "
      "fastest / mwms |"), text
  assert ("| mlp | 8mbit | 2 | 1 | 2 | 2.00 | 2.50 | 4.00 | 5.00 | 0.80 | "
          "0.22; 0.22; 0.11; 0.10 | 0.80; 1.00; 0.80; 0.50 |") in lines, text


def test_the_split_mlp_spreads_every_matrix_over_the_ps_tasks():
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(support.TOOLS))
  import _bench_task  # pylint: disable=g-import-not-at-top

  cluster = tf.train.ClusterSpec({"ps": ["a:1", "b:1", "c:1", "d:1"],
                                  "worker": ["w:1"]})

  def shards(scenario):
    with tf.Graph().as_default(), tf.compat.v1.device(
        tf.compat.v1.train.replica_device_setter(cluster=cluster)):
      tf.compat.v1.train.get_or_create_global_step()
      _bench_task.build_model(scenario, np.random.default_rng(0), ps_tasks=4)
      return _bench_task.ps_shard_bytes(tf.compat.v1.trainable_variables())

  whole, split = shards("mlp"), shards("mlp_split")
  assert sum(whole.values()) == sum(split.values())
  # Round-robin puts the 784x256 matrix, 3/4 of the model, on one task...
  assert max(whole.values()) > 0.7 * sum(whole.values()), whole
  # ...split, every task holds a quarter.
  assert max(split.values()) < 1.01 * sum(split.values()) / 4, split


@pytest.mark.parametrize("argv, said", [
    (["--ps", "0"], "--workers and --ps take positive counts"),
    (["--workers", "2,x"], "invalid literal"),
    (["--link-rate", "fast"], "a link rate is a positive number and a unit"),
    (["--impls", "ours,mwms,mwms_ring"], "one MultiWorkerMirroredStrategy"),
    (["--variant", "a={}", "--variant", "a={}"], "its NAME is used twice"),
], ids=["no-ps", "bad-count", "bad-rate", "two-peers", "variant-twice"])
def test_bad_arguments_stop_before_any_namespace_or_host(argv, said,
                                                         capsys):
  linkcost = support.load_tool("linkcost")
  with pytest.raises(SystemExit) as stopped:
    linkcost.main(argv)
  assert stopped.value.code == 2
  assert said in capsys.readouterr().err


#: The committed runs (docs/scaling.md's tables are their renders).
SAVED = ROOT / "docs" / "linkcost"


def _rows(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _render(capsys, *argv):
  """``tools/linkcost --render ...``: (exit status, stdout, stderr), with
  no namespace, host or pool possible."""
  linkcost = support.load_tool("linkcost")

  def no_run(*_, **__):
    raise AssertionError("--render started hosts or a run")

  linkcost._hosts_up = no_run
  linkcost._run = no_run
  try:
    status = linkcost.main(["--render", *map(str, argv)])
  except SystemExit as e:
    status = e.code
  out, err = capsys.readouterr()
  return status, out, err


@pytest.mark.version_independent
@pytest.mark.parametrize("name", sorted(p.name for p in SAVED.glob("*.jsonl")))
def test_render_prints_each_committed_runs_tables(name, capsys):
  linkcost = support.load_tool("linkcost")
  rows = _rows(SAVED / name)
  for extra, shape in (([], linkcost.table), (["--compact"], linkcost.compact)):
    assert _render(capsys, SAVED / name, *extra) == (
        0, shape(rows) + "\n", "")


@pytest.mark.version_independent
def test_render_of_the_committed_runs_is_what_scaling_md_shows():
  # The commands docs/scaling.md gives under its 100 Mbit/s tables, as a
  # user runs them: every line of each compact table is in the doc.
  doc = (ROOT / "docs" / "scaling.md").read_text().splitlines()
  for name in ("mlp-100mbit.jsonl", "many-sparse-100mbit.jsonl"):
    command = "tools/linkcost --render docs/linkcost/%s --compact" % name
    assert any(command in line for line in doc), command
    proc = subprocess.run(
        [sys.executable, *command.split()], cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=False)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) > 2 and [l for l in lines if l not in doc] == [], (
        proc.stdout)


def _render_error_case(case, tmp_path):
  """The --render arguments of ``case``, and what its one line must say."""
  runs = _rows(SAVED / "mlp-w8-1gbit.jsonl")
  copy = tmp_path / "runs.jsonl"
  if case == "missing":
    return [tmp_path / "nothing.jsonl"], [
        "no such file: %s" % (tmp_path / "nothing.jsonl"),
        "tools/linkcost writes runs.jsonl into its --out folder"]
  if case == "folder":
    return [tmp_path], ["%s is a folder: give the runs.jsonl in it (%s)" % (
        tmp_path, copy)]
  if case == "empty":
    copy.write_text("\n")
    return [copy], ["%s holds no runs" % copy, "a runs.jsonl with runs in it"]
  if case == "cut_short":
    # A run killed while it wrote its last line.
    text = (SAVED / "mlp-w8-1gbit.jsonl").read_text()
    copy.write_text(text[:text.index("\n", 5000) + 700])
    line = text[:text.index("\n", 5000)].count("\n") + 2
    return [copy], ["%s line %d is not JSON" % (copy, line),
                    "a line cut short is a run that was being written"]
  if case == "table_md":
    (tmp_path / "table.md").write_text(support.load_tool("linkcost").table(
        runs) + "\n")
    return [tmp_path / "table.md"], ["table.md line 1 is not JSON",
                                     "one JSON object a line"]
  if case == "bench_runs":
    peers = ROOT / "docs" / "peers" / "after-2026-11-28.jsonl"
    return [peers], ["%s line 1 is tools/bench's" % peers,
                     "tools/bench --render"]
  if case == "a_list":
    copy.write_text("[1, 2]\n")
    return [copy], ["line 1 is a JSON list, not an object"]
  if case == "a_key_missing":
    _write(copy, runs[:2] + [{k: v for k, v in runs[2].items()
                              if k != "busiest_bytes"}])
    return [copy], ["%s line 3 has no busiest_bytes" % copy,
                    "give the runs.jsonl of a tools/linkcost --out folder"]
  if case == "edited_rate":
    _write(copy, runs[:4] + [dict(runs[4], link_bits=1e8)])
    return [copy], ["%s line 5 has link_bits 100000000.0, where "
                    "tools/linkcost writes the bits a second of its "
                    "link_rate (1000000000.0)" % copy]
  if case == "edited_count":
    _write(copy, runs[:1] + [dict(runs[1], workers="8")])
    return [copy], ['%s line 2 has workers "8", where tools/linkcost writes '
                    "an int, 1 or more" % copy]
  if case == "a_line_twice":
    _write(copy, runs + runs[:1])
    return [copy], ["%s line %d repeats %s line 1" % (
        copy, len(runs) + 1, copy), "one run would count twice"]
  if case == "a_file_twice":
    return [SAVED / "mlp-w8-1gbit.jsonl"] * 2, ["is given twice"]
  if case == "two_builds_in_two_files":
    # The committed 200 and 100 Mbit/s runs: "fastest" gained
    # prefetch_variable_reads between them.
    a, b = SAVED / "mlp-200mbit.jsonl", SAVED / "mlp-100mbit.jsonl"
    return [a, b], ["'fastest' has options", "at %s line 4 but" % a,
                    '"prefetch_variable_reads": true', "at %s line 3" % b,
                    "would mix two builds"]
  if case == "two_builds_in_one_file":
    # A second run appended to the same --out with another "fastest".
    later = [dict(r, rep=r["rep"] + 1, options={"transfer_dtype": "float16"})
             if r["impl"] == "fastest" else dict(r, rep=r["rep"] + 1)
             for r in runs]
    _write(copy, runs + later)
    first = 1 + [r["impl"] for r in runs].index("fastest")
    return [copy], ["'fastest' has options", "at %s line %d but "
                    '{"transfer_dtype": "float16"} at %s line %d' % (
                        copy, first, copy, len(runs) + first)]
  assert case == "a_model_of_two_sizes", case
  _write(copy, [dict(r, model_bytes=2 * r["model_bytes"], rep=9)
                for r in runs if r["scenario"] == "mlp"])
  return [SAVED / "mlp-w8-1gbit.jsonl", copy], [
      "'mlp' has model_bytes 1077288", "but 2154576 at %s line 1" % copy]


@pytest.mark.version_independent
@pytest.mark.parametrize("case", [
    "missing", "folder", "empty", "cut_short", "table_md", "bench_runs",
    "a_list", "a_key_missing", "edited_rate", "edited_count", "a_line_twice",
    "a_file_twice", "two_builds_in_two_files", "two_builds_in_one_file",
    "a_model_of_two_sizes"])
def test_render_refuses_what_is_not_its_runs_or_cannot_merge(case, tmp_path,
                                                             capsys):
  paths, said = _render_error_case(case, tmp_path)
  status, out, err = _render(capsys, *paths)
  assert (status, out) == (2, ""), out
  assert err.startswith("linkcost --render: ") and err.count("\n") == 1, err
  assert [s for s in said if s not in err] == [], err


@pytest.mark.version_independent
def test_render_merges_files_and_refuses_the_options_of_a_run(capsys):
  linkcost = support.load_tool("linkcost")
  # Files of one build merge: the 200 Mbit/s and 1 Gbit/s runs, one table.
  a, b = SAVED / "mlp-200mbit.jsonl", SAVED / "mlp-w8-1gbit.jsonl"
  assert _render(capsys, a, b, "--compact") == (
      0, linkcost.compact(_rows(a) + _rows(b)) + "\n", "")
  for argv, said in (
      (["--render", str(a), "--workers", "4"],
       "so --workers would do nothing: drop it"),
      (["--render", str(a), "--reps", "2", "--out", "x"],
       "so --reps and --out would do nothing: drop them"),
      (["--compact"], "--compact shapes the table of --render")):
    with pytest.raises(SystemExit) as stopped:
      linkcost.main(argv)
    assert stopped.value.code == 2
    assert said in capsys.readouterr().err

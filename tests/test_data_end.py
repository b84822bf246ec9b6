"""Uneven shards as process clusters: who trains, who exits (issue 36).

Each test runs ``tools/data_end`` (in this process, so that no extra
TensorFlow import is paid for the harness) on 3 replica processes and a ps,
a server of this process (``InProcessPs``: its process would be one
TensorFlow import of four per cluster, and what is proven is about the
replicas' processes; the ps runs none of the package's code), every replica
reading its own one-pass shard of a few batches until its
input raises OutOfRangeError: under MonitoredTrainingSession, a Supervisor
whose input queue closes, and an Estimator with a finite ``input_fn``
(TensorFlow 2.15 only). The harness counts the batches trained from the
updates the ps applied (its recorder variable), not from the replicas, and
reports each process's exit code, the seconds from its last batch to its
exit, the global step at its exit, or that it hung.

* ours' default, ``data_end="train_all"``: every process exits 0 within
  EXIT_SECS of its last batch, every batch is trained, and each update's
  gradients sum to one (no batch counted twice);
* ``"stop_together"``: every process exits 0, each at the same global step;
* ours' ``"stock"`` policy and stock's class, side by side, in lockstep
  (no init tokens, so that the outcome is always the same): stock's hang
  when a non-chief ends first, reported by the harness as a hang (no batch
  or exit for HANG_IDLE_SECS while a replica with data left runs) that
  names who hung, after which every process is gone; and the chief ending
  first closes the token queue, which ends the others with their batches
  unread.

Whatever a run found, the harness stopped every process it started.

The tests of ours' policies need its ``data_end`` option; until the feature
is in the checkout they skip, saying so.
"""

import importlib.util

import pytest

import support

data_end = support.load_tool("data_end")

HAS_ESTIMATOR = importlib.util.find_spec("tensorflow_estimator") is not None

#: A process exits within this of its last batch. A prompt exit takes a few
#: seconds here, most of them Python's and TensorFlow's teardown (5-7 s on
#: a 2-core machine loaded 7 times over); a close that waits out stock's
#: grace (GRACE_SECS) takes that grace, and a chief that waits for the
#: others' last batches waits a second or two of their training.
EXIT_SECS = 60
#: Every close gets stock's grace period, so a close that is not prompt
#: cannot pass EXIT_SECS.
GRACE_SECS = support.STOCK_GRACE_SECS
#: No batch trained for this long while a replica with data left runs is a
#: hang. A step takes milliseconds, a first step a few seconds on a loaded
#: machine; a hung replica waits for a token for good.
IDLE_SECS = 20
#: The idle bound of the stock-hang cases. tools/data_end counts it from the
#: last batch or exit, so it starts once the replica whose shard ended has
#: gone: in lockstep the others then wait for a gradient that no live
#: replica will send, a state that cannot change by itself, and the bound
#: only has to outlast what would change it were there no hang: ours'
#: chief looks for ended replicas every 0.2 s and a step takes milliseconds
#: (a policy that went on training would train a batch within the bound and
#: break the test's count). Before the first batch, and while a replica
#: closes, the harness waits at least its SLOW_SECS. It was IDLE_SECS, 20 s
#: of waiting per case.
HANG_IDLE_SECS = 5
#: The harness stops everything this long after training started.
DEADLINE_SECS = 200
#: Starting four TensorFlow processes on a loaded machine, the deadline,
#: and the clean-up.
TEST_TIMEOUT_SECS = 600

#: Shards (batches per replica, the chief's first), ending in each order.
NON_CHIEF_FIRST = [12, 4, 12]
CHIEF_FIRST = [4, 12, 12]
EQUAL = [8, 8, 8]
SHARD_NAMES = {tuple(NON_CHIEF_FIRST): "non-chief-first",
               tuple(CHIEF_FIRST): "chief-first", tuple(EQUAL): "equal"}
#: Seeds of tools/data_end's random sizes, each with an empty shard.
SEEDS = {19: [10, 0, 12], 31: [0, 7, 1]}
#: Stock's class, and ours with stock's policy. Their tests pass
#: ``init_tokens=0`` (stock's ``num_tokens=0``): the first update then waits
#: for every replica, and the replicas go in lockstep, one batch each per
#: update, so that the outcome is always the same. With the default init
#: tokens a chief whose first steps come first can make updates alone, and
#: then ends first itself (tools/data_end's runs: stock with shards 30/10/30
#: hung in 3 of 5 runs, and in 2 the chief trained its 30 batches while
#: replica 1 had trained none and was stopped by the closed token queue).
STOCK_BEHAVIOUR = [
    pytest.param("stock", None, id="stock"),
    pytest.param("ours", "stock", id="ours-stock-policy"),
]

_STOCK_POLICY_HANGS = (
    "ours with stock's policy runs stock's path: stock's own class hangs "
    "under every driver and version here, ours with it under the "
    "Estimator (2.15) and test_data_end_protocol's stock-policy tests")

#: The clusters CI's older TensorFlow (2.15, 21 clusters where 2.21 has 16,
#: its Estimator's included) leaves to the newest, each for a reason: what
#: TensorFlow does in it (a driver ending on its input's OutOfRangeError,
#: stock's token queue) runs there in a case it keeps; what differs is
#: ours' bookkeeping, which no TensorFlow version changes.
NEWEST_ONLY_CASES = {
    ("default", "mts", "chief-first"): (
        "the chief's input ending first: TensorFlow's part (the chief's "
        "driver ending on OutOfRangeError) runs under every version in "
        "stop_together's and stock's chief-first cases and the Estimator's"),
    ("default", "supervisor", "chief-first"): (
        "the chief's input ending first under a Supervisor: the Supervisor's "
        "end on a closed input queue runs under every version in its "
        "non-chief-first cases, the chief's end in MTS's and the Estimator's"),
    ("default", "mts", "equal"): (
        "equal shards end together: each replica's end is the same "
        "TensorFlow path as in the non-chief-first case under every version"),
    ("default", "mts", "seed"): (
        "random shards with an empty one: a shard of no batches ends cleanly "
        "under every version in test_data_end_protocol's "
        "test_a_shard_of_no_batches_ends_cleanly, the ends in the fixed "
        "shards' cases"),
    ("stock-hang", "mts", "ours-stock-policy"): _STOCK_POLICY_HANGS,
    ("stock-hang", "supervisor", "ours-stock-policy"): _STOCK_POLICY_HANGS,
    ("stock-chief-first", "mts", "ours-stock-policy"): (
        "ours with stock's policy runs stock's path, which stock's own class "
        "runs in this test under every version"),
}


def newest_only_case(*key):
  """Skips a case that NEWEST_ONLY_CASES leaves to CI's newest TensorFlow."""
  if key in NEWEST_ONLY_CASES:
    support.newest_only_here(NEWEST_ONLY_CASES[key])


#: A stock hang under a Supervisor: the hang is stock's token queue, the
#: driver only what waits on it.
_STOCK_HANG_SHOWN = (
    "a second proof (a process cluster, about 5 CPU-seconds): the hang "
    "itself is shown by this test's mts cases (stock's class and ours with "
    "stock's policy, the same token queue), and the Supervisor's loop ending "
    "on its input by test_default_trains_every_batch_and_every_process_exits"
    "[supervisor-non-chief-first]")

#: The clusters ./tools/test leaves to --all (and CI), each a second proof
#: whose parts default cases prove apart (the reason names them).
SCALE_CASES = {
    ("default", "supervisor", "chief-first"): (
        "a second proof (a process cluster, about 5 CPU-seconds): the chief's "
        "input ending first is proven as processes by [mts-chief-first], a "
        "Supervisor's loop as processes by [supervisor-non-chief-first], and "
        "a Supervisor loop whose chief ends first in process by "
        "test_data_end_protocol's test_a_supervisor_loop_announces_its_end_"
        "with_one_call[chief_first]"),
    ("default", "mts", "seed-19"): (
        "a second proof (a process cluster, about 5 CPU-seconds): a drawn "
        "seed's shards, one empty, run as processes in [seed-31] (the chief's "
        "empty), a worker's input ending before the others' in [mts-non-"
        "chief-first], and a worker with no batch at all in process in "
        "test_data_end_protocol's test_a_shard_of_no_batches_ends_cleanly"
        "[a_worker_has_no_data]; this case's draw is still checked first"),
    ("default", "mts", "equal"): (
        "a second proof (a process cluster, about 5 CPU-seconds): equal "
        "shards ending together with every batch trained once are proven in "
        "process by test_data_end_protocol's test_every_process_ends_and_"
        "every_batch_after_the_start_is_trained[equal], every replica "
        "process exiting promptly after its input ended under MTS by "
        "[mts-non-chief-first] and [mts-chief-first]"),
    ("stock-hang", "supervisor", "stock"): _STOCK_HANG_SHOWN,
    ("stock-hang", "supervisor", "ours-stock-policy"): _STOCK_HANG_SHOWN,
}


def scale_case(*key):
  """Skips a case that SCALE_CASES leaves to ./tools/test --all."""
  if key in SCALE_CASES:
    support.scale_here(SCALE_CASES[key])


DRIVERS = [
    pytest.param("mts", id="mts"),
    pytest.param("supervisor", id="supervisor"),
    pytest.param("estimator", id="estimator", marks=pytest.mark.skipif(
        not HAS_ESTIMATOR, reason="tf.estimator is gone from TensorFlow "
        "2.16: the Estimator runs in CI's TensorFlow 2.15 venv")),
]


def run(tmp_path, *, impl, shards=None, seed=None, driver="mts",
        policy=None, init_tokens=-1, grace=GRACE_SECS, idle=IDLE_SECS):
  """One cluster through tools/data_end; returns its summary."""
  argv = ["--impl", impl, "--driver", driver, "--grace", str(grace),
          "--idle", str(idle), "--deadline", str(DEADLINE_SECS),
          "--init-tokens", str(init_tokens)]
  if seed is None:
    argv += ["--shards", ",".join(map(str, shards))]
  else:
    argv += ["--seed", str(seed), "--workers", "3", "--max-batches", "12"]
  if policy is not None:
    argv += ["--policy", policy]
  args = data_end.parse(argv)
  # The Estimator imports Keras, which the tests' children do without.
  environ = support.with_keras() if driver == "estimator" else None
  # Its replicas are forked from the fork server (support.start_task).
  summary = data_end.run_once(args, tmp_path / "run", environ=environ,
                              ps_in_process=True, popen=support.start_task)
  # Whatever happened, the harness stopped every task it started.
  assert not summary["processes_left"], describe(summary)
  # What the idle bound left out (a replica busy or starved of CPU), for
  # a run beside other work (-s).
  print("%s; %.1f s without progress discounted as busy or starved" % (
      summary["ended"], summary["starved_secs"]))
  return summary


def describe(summary):
  """The run in one table row, with where its logs are, for a failure."""
  return "%s\nlogs: %s" % (data_end.row(summary), summary["logs"])


def assert_every_process_exited_promptly(summary):
  assert not summary["hung"], describe(summary)
  for w in summary["workers"]:
    assert w["exit_code"] == 0, describe(summary)
    assert w["secs_last_batch_to_exit"] < EXIT_SECS, describe(summary)


@pytest.mark.timeout(TEST_TIMEOUT_SECS)
@pytest.mark.parametrize("shards", [
    pytest.param(NON_CHIEF_FIRST, id="non-chief-first"),
    pytest.param(CHIEF_FIRST, id="chief-first"),
    pytest.param(EQUAL, id="equal"),
])
@pytest.mark.parametrize("driver", DRIVERS)
def test_default_trains_every_batch_and_every_process_exits(
    tmp_path, driver, shards):
  if driver != "mts" and shards is EQUAL:
    pytest.skip("equal shards run under MonitoredTrainingSession only: "
                "each process cluster costs the suite about 20 CPU-seconds")
  newest_only_case("default", driver, SHARD_NAMES[tuple(shards)])
  scale_case("default", driver, SHARD_NAMES[tuple(shards)])
  summary = run(tmp_path, impl="ours", shards=shards, driver=driver)
  assert_every_process_exited_promptly(summary)
  assert summary["trained"] == summary["total"], describe(summary)
  assert [w["trained"] for w in summary["workers"]] == shards, describe(
      summary)
  # Every update averages its gradients: ``seen`` grows by one per update,
  # so a batch applied twice, or an update without the recorder, shows.
  assert summary["seen_sum"] == pytest.approx(summary["updates"],
                                              abs=1e-3), describe(summary)


@pytest.mark.timeout(TEST_TIMEOUT_SECS)
@pytest.mark.parametrize("seed", sorted(SEEDS), ids="seed-{}".format)
def test_default_trains_random_shards_with_an_empty_one(tmp_path, seed):
  assert data_end.draw_shards(seed, workers=3, max_batches=12) == SEEDS[seed]
  newest_only_case("default", "mts", "seed")
  scale_case("default", "mts", "seed-%d" % seed)
  summary = run(tmp_path, impl="ours", seed=seed)
  assert_every_process_exited_promptly(summary)
  assert summary["trained"] == summary["total"], describe(summary)
  assert [w["trained"] for w in summary["workers"]] == SEEDS[seed], describe(
      summary)


@pytest.mark.timeout(TEST_TIMEOUT_SECS)
@pytest.mark.parametrize("shards", [
    pytest.param(NON_CHIEF_FIRST, id="non-chief-first"),
    pytest.param(CHIEF_FIRST, id="chief-first"),
])
@pytest.mark.parametrize("driver", DRIVERS)
def test_stop_together_ends_every_replica_at_one_global_step(
    tmp_path, driver, shards):
  if driver != "mts" and shards is CHIEF_FIRST:
    pytest.skip("the chief ending first runs under MonitoredTrainingSession "
                "only: each process cluster costs the suite about 20 "
                "CPU-seconds")
  summary = run(tmp_path, impl="ours", shards=shards, driver=driver,
                policy="stop_together")
  assert_every_process_exited_promptly(summary)
  steps = {w["final_step"] for w in summary["workers"]}
  assert len(steps) == 1, describe(summary)
  # The first shard to end stops everyone: the rest of the others' batches
  # are dropped, and nothing is trained twice.
  assert summary["trained"] < summary["total"], describe(summary)
  assert summary["seen_sum"] == pytest.approx(summary["updates"],
                                              abs=1e-3), describe(summary)


@pytest.mark.timeout(TEST_TIMEOUT_SECS)
@pytest.mark.parametrize("impl,policy", STOCK_BEHAVIOUR)
@pytest.mark.parametrize("driver", DRIVERS)
def test_stock_hangs_when_a_non_chief_ends_first(tmp_path, driver, impl,
                                                 policy):
  newest_only_case("stock-hang", driver,
                   "stock" if policy is None else "ours-stock-policy")
  scale_case("stock-hang", driver,
             "stock" if policy is None else "ours-stock-policy")
  summary = run(tmp_path, impl=impl, policy=policy, shards=NON_CHIEF_FIRST,
                driver=driver, init_tokens=0, idle=HANG_IDLE_SECS)
  # Lockstep: each update took one batch of each replica, until replica 1's
  # shard ended; then the other two pushed once more and wait for a third
  # gradient, and the token it would bring, for good.
  assert summary["ended"].startswith("no batch trained"), describe(summary)
  assert summary["hung"] == [0, 2], describe(summary)
  ended = summary["workers"][1]
  assert ended["exit_code"] == 0 and ended["ended_by"] == "data", describe(
      summary)
  assert summary["trained"] == 3 * NON_CHIEF_FIRST[1], describe(summary)


@pytest.mark.timeout(TEST_TIMEOUT_SECS)
@pytest.mark.parametrize("impl,policy", STOCK_BEHAVIOUR)
def test_stock_chief_ending_first_stops_the_others_with_data_left(
    tmp_path, impl, policy):
  newest_only_case("stock-chief-first", "mts",
                   "stock" if policy is None else "ours-stock-policy")
  # The chief's close is not what this test checks: a short grace.
  summary = run(tmp_path, impl=impl, policy=policy, shards=CHIEF_FIRST,
                init_tokens=0, grace=5)
  assert not summary["hung"], describe(summary)
  chief, *others = summary["workers"]
  assert chief["ended_by"] == "data", describe(summary)
  # The chief's close closes the token queue: the others' next token take
  # ends their sessions as if training were done, their shards unread.
  for w in others:
    assert w["exit_code"] == 0, describe(summary)
    assert w["ended_by"] == "token queue closed", describe(summary)
  assert summary["trained"] == 3 * CHIEF_FIRST[0], describe(summary)


@pytest.mark.parametrize("argv,says", [
    pytest.param(["--impl", "stock", "--policy", "stop_together"],
                 "stock's class has none", id="policy-with-stock"),
    pytest.param(["--shards", "0,0,0"], "at least one batch",
                 id="no-batch"),
    pytest.param(["--shards", "3,x,3"], "comma-separated", id="not-ints"),
    pytest.param(["--shards", "3,1,3", "--backups", "3"],
                 "--backups must be in [0, 3)", id="backups"),
    pytest.param(["--shards", "3,1,3", "--seed", "1"], "not both",
                 id="shards-and-seed"),
    pytest.param(["--idle", "0"], "--idle must be > 0", id="idle"),
    pytest.param(["--driver", "estimator"], "gone from TensorFlow 2.16",
                 id="estimator-on-2.16-and-later", marks=pytest.mark.skipif(
                     HAS_ESTIMATOR, reason="this TensorFlow has tf.estimator")),
])
def test_bad_arguments_are_refused_before_any_process_starts(argv, says,
                                                            capsys):
  with pytest.raises(SystemExit) as raised:
    data_end.parse(argv)
  assert raised.value.code == 2
  assert says in capsys.readouterr().err


def test_seeded_shards_are_the_same_for_a_seed_and_never_all_empty():
  for seed in range(50):
    shards = data_end.draw_shards(seed, workers=3, max_batches=2)
    assert shards == data_end.draw_shards(seed, workers=3, max_batches=2)
    assert sum(shards) > 0 and all(0 <= s <= 2 for s in shards)

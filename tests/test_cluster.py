"""The loopback cluster helpers."""

import random
import socket

import pytest

import sync_replicas
from sync_replicas import _ports
from sync_replicas import cluster as cluster_lib

pytestmark = pytest.mark.quick  # In ./tools/test --quick.


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
  ports = cluster_lib.free_ports(20)
  assert len(set(ports)) == 20
  low, _ = _ports._ephemeral_range()  # pylint: disable=protected-access
  assert all(p < low for p in ports)
  for port in ports:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
      sock.bind(("127.0.0.1", port))


def test_local_cluster_names_loopback_tasks():
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  spec = cluster.cluster_spec.as_dict()
  assert sorted(spec) == ["ps", "worker"]
  for address in spec["ps"] + spec["worker"]:
    assert address.startswith("127.0.0.1:")
  assert cluster.worker_targets == ["grpc://" + a for a in spec["worker"]]


def test_free_ports_keep_to_the_range_a_parallel_test_process_was_given(
    monkeypatch):
  # tools/test gives each pytest process it runs side by side a range of
  # its own: two processes never draw the same port before a bind.
  monkeypatch.setenv(_ports.PORT_RANGE_ENV, "20000-20050")
  ports = cluster_lib.free_ports(10)
  assert len(set(ports)) == 10 and all(20000 <= p < 20050 for p in ports)
  for bad in ("20000", "a-b", "20050-20000", "80-90"):
    monkeypatch.setenv(_ports.PORT_RANGE_ENV, bad)
    with pytest.raises(ValueError, match="SYNC_REPLICAS_PORT_RANGE must be "
                                         "LOW-HIGH with 1024 <= LOW < HIGH"):
      cluster_lib.free_ports(1)


def test_free_ports_never_hand_out_a_port_twice_before_it_is_bound(
    monkeypatch):
  # Two clusters started side by side from one process (test_user_scripts'
  # stock and ours) draw their ports before either binds them, so each
  # still tests free: CI lost a run to one server that could not bind.
  monkeypatch.setenv(_ports.PORT_RANGE_ENV, "20000-20100")
  first = cluster_lib.free_ports(3, rng=random.Random(7))
  second = cluster_lib.free_ports(3, rng=random.Random(7))  # The same draws.
  assert not set(first) & set(second), (first, second)
  # Only half of a small range is kept out: it never runs dry.
  for _ in range(40):
    assert len(cluster_lib.free_ports(3)) == 3

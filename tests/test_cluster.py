"""The loopback cluster helpers."""

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

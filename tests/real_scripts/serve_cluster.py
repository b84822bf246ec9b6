"""Serves a loopback cluster (ps and worker servers) until killed.

music_vae_train.py only connects to ``--master``: it expects the servers to
exist (as a cluster manager would run them). This process is those servers:
it prints one line ``targets <json>`` with the workers' session targets,
then serves until the test kills it.
"""

import json
import sys
import threading

import sync_replicas


def main(argv):
  num_workers, num_ps = int(argv[1]), int(argv[2])
  cluster = sync_replicas.LocalCluster(num_workers=num_workers, num_ps=num_ps)
  print("targets " + json.dumps(cluster.worker_targets), flush=True)
  threading.Event().wait()  # Killed by the test.


if __name__ == "__main__":
  main(sys.argv)

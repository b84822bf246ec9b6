"""The command-line tools an operator runs, installed with the package.

Owns nothing but this list; each tool is a module with ``main(argv=None)``,
declared as a console script in setup.cfg and runnable with ``python -m``:

  sync-replicas-launch   (``sync_replicas.cli.launch``): runs a
                         between-graph program as a whole cluster of
                         processes on this machine, confined to a private
                         network namespace.
  sync-replicas-slurm    (``sync_replicas.cli.slurm``): runs a
                         between-graph program as a Slurm job step, one
                         TensorFlow task per Slurm task (under srun).
  sync-replicas-status   (``sync_replicas.cli.status``): prints the live sync
                         state of a running job, read-only.

Every tool answers ``--help`` and ``--version``, and exits 0 when done, 1 when
it could not do it, 2 on bad arguments and 130 on Ctrl-C (``_cli``). Importing
this package or the launcher does not import TensorFlow.
"""

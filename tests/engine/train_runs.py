"""Run under torchrun by test_distributed.py: several ``fastoptim train`` runs, one after another, in the same
processes. Each run goes through ``fastoptim.cli.main``, which ``python -m fastoptim`` calls, so a run is the
command's own: its config, process group, training, checkpoints and --json summary. Sharing the processes
saves a torchrun start and two torch imports per run, which cost far more than the tiny runs themselves.

Usage: ``torchrun --standalone --nproc_per_node=N train_runs.py PLAN.json [PARITY.json [LEVELS]]``, PLAN a list
of argument lists (``["train", "--ddp", ...]``). With PARITY, dist_worker.py's checks (at LEVELS, comma-separated;
all by default) run first and write their results there: one launch fewer. The first run that fails stops the
launch, named on stderr."""

import json
import sys

from torch.distributed import distributed_c10d
from torch.distributed.tensor import debug as dtensor_debug

from fastoptim.cli import main


def run_all(plan: list[list[str]]) -> int:
    for i, argv in enumerate(plan):
        # torchrun's store outlives each run's process group, and destroy_process_group starts naming groups at
        # 0 again: the next run's group would find the last one's rendezvous keys in the store (and connect to
        # ranks' sockets that are gone). Each run's groups take names of their own.
        distributed_c10d._world.group_count = 1000 * (i + 1)
        # DTensor caches sharding decisions by mesh value: the last run's mesh (and its gone group) would come back
        dtensor_debug._clear_sharding_prop_cache()
        code = main(argv)
        if code != 0:
            print(f"train_runs.py: run {i} exited {code}: {' '.join(argv)}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2:
        import dist_worker  # beside this file
        dist_worker.main(sys.argv[2], *([sys.argv[3].split(",")] if len(sys.argv) > 3 else []))
    with open(sys.argv[1]) as f:
        sys.exit(run_all(json.load(f)))

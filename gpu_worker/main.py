"""python -m gpu_worker --config-file RUN/config.json [--rank R --dist-init-addr HOST:PORT]

Without --rank (or with --rank 0) this is the worker the scheduler talks to (rank 0 of a
tensor-parallel group when --tensor-parallel-size > 1); --rank R > 0 starts a follower rank
(gpu_worker/rank.py). One process per rank and device.
"""

import argparse
import sys

from common.actor import Actor
from common.config import Config
from common.entry import run_actor
from gpu_worker.worker import WorkerActor


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rank", type=int, default=0, help="global rank in the tensor-parallel group"
    )


def _build(config: Config, args: argparse.Namespace) -> Actor:
    if args.rank == 0:
        return WorkerActor(config)
    from gpu_worker.rank import RankFollower

    return RankFollower(config, args.rank)


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    _flags(pre)
    rank = pre.parse_known_args(argv)[0].rank
    name = "worker" if rank == 0 else f"worker-rank-{rank}"  # its log lines' "proc"
    return run_actor(name, _build, argv, _flags)


if __name__ == "__main__":
    sys.exit(main())

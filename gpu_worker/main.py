"""python -m gpu_worker --config-file RUN/config.json"""

import sys

from common.entry import run_actor
from gpu_worker.worker import WorkerActor


def main(argv: list[str] | None = None) -> int:
    return run_actor("worker", lambda config, _args: WorkerActor(config), argv)


if __name__ == "__main__":
    sys.exit(main())

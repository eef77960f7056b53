"""python -m services.scheduler --config-file RUN/config.json"""

import sys

from common.entry import run_actor
from services.scheduler.actor import SchedulerActor


def main(argv: list[str] | None = None) -> int:
    return run_actor("scheduler", lambda config, _args: SchedulerActor(config), argv)


if __name__ == "__main__":
    sys.exit(main())

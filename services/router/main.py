"""python -m services.router --config-file RUN/config.json (with --data-parallel-size > 1)"""

import sys

from common.entry import run_actor
from services.router.actor import RouterActor


def main(argv: list[str] | None = None) -> int:
    return run_actor("router", lambda config, _args: RouterActor(config), argv)


if __name__ == "__main__":
    sys.exit(main())

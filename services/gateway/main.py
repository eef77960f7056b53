"""python -m services.gateway --config-file RUN/config.json"""

import sys

from common.entry import run_actor
from services.gateway.actor import GatewayActor


def main(argv: list[str] | None = None) -> int:
    return run_actor("gateway", lambda config, _args: GatewayActor(config), argv)


if __name__ == "__main__":
    sys.exit(main())

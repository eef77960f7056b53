"""python -m services.gateway --config-file RUN/config.json [--index I --listen-fd FD]"""

import argparse
import sys

from common.config import Config
from common.entry import run_actor
from common.topology import gateway_name, num_gateways
from services.gateway.actor import GatewayActor


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--index", type=int, default=0, help="which of the gateway processes this is"
    )
    parser.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="serve HTTP on this inherited listening socket (the supervisor's) instead of "
        "binding --host:--port",
    )


def _name(config: Config, args: argparse.Namespace) -> str:
    return gateway_name(args.index, num_gateways(config))


def main(argv: list[str] | None = None) -> int:
    return run_actor(
        "gateway", lambda c, a: GatewayActor(c, a.index, a.listen_fd), argv, _flags, _name
    )


if __name__ == "__main__":
    sys.exit(main())

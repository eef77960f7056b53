"""python -m services.detokenizer --config-file RUN/config.json"""

import sys

from common.entry import run_actor
from services.detokenizer.actor import DetokenizerActor


def main(argv: list[str] | None = None) -> int:
    return run_actor("detokenizer", lambda config, _args: DetokenizerActor(config), argv)


if __name__ == "__main__":
    sys.exit(main())

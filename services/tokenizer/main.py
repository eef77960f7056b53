"""python -m services.tokenizer --config-file RUN/config.json --index I"""

import argparse
import sys

from common.entry import run_actor
from services.tokenizer.actor import TokenizerActor


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index", type=int, default=0, help="which tokenizer process this is")


def main(argv: list[str] | None = None) -> int:
    return run_actor("tokenizer", lambda c, a: TokenizerActor(c, a.index), argv, _flags)


if __name__ == "__main__":
    sys.exit(main())

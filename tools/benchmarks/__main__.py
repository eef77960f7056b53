import sys

from tools.benchmarks.cli import main

sys.exit(main())

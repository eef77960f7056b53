import sys

from tools.gpu_check.cli import main

sys.exit(main())

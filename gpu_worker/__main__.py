import sys

from gpu_worker.main import main

sys.exit(main())

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# as in the worker (gpu_worker/__init__.py), before anything imports torch: OpenMP threads
# sleep instead of spinning at barriers, so in-process model runs do not crawl when another
# job holds a core (a spinning thread waits for one that is not scheduled)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

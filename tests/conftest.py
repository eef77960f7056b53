import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# before anything imports torch, and inherited by every server a test starts: OpenMP threads
# sleep at once instead of spinning at barriers (the worker's default spins briefly first,
# gpu_worker/__init__.py), so model runs do not crawl when another job holds a core (a
# spinning thread waits for one that is not scheduled): CI machines are shared
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "0")

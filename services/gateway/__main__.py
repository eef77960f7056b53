import sys

from services.gateway.main import main

sys.exit(main())

import sys

from services.detokenizer.main import main

sys.exit(main())

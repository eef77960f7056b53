import sys

from services.tokenizer.main import main

sys.exit(main())

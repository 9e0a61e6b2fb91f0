"""`python -m jpaged.serve`."""

import sys

from jpaged.serve.cli import main

sys.exit(main())

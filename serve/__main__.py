"""`python -m serve ...` is the `xlaserve` command."""

import sys

from serve.cli import main

sys.exit(main())

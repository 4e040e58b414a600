"""`python -m megatron_deadpool.cli ...`: the `deadpool` command."""

import sys

from megatron_deadpool.cli.main import main

sys.exit(main())

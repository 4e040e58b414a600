"""`python -m megatron_deadpool.megatron_lm SCRIPT ARGS`: run a Megatron-LM script with DeadPool."""

import sys

from megatron_deadpool.megatron_lm.runner import main

sys.exit(main())

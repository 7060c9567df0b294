"""``python -m flashdmoe.ranks SPEC.json``: one rank process (:mod:`flashdmoe.ranks.child`)."""

import os
import sys

from flashdmoe.ranks.child import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# No interpreter teardown (atexit hooks of NVSHMEM or CUDA libraries) after the team was closed: the
# results are already on disk.
os._exit(code)

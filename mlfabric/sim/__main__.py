"""python -m mlfabric.sim: see mlfabric.sim.cli."""
import sys

from .cli import main

sys.exit(main())

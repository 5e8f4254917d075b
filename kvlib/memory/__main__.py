"""`python -m kvlib.memory`: see `kvlib.memory.cli`."""

from kvlib.memory.cli import main

raise SystemExit(main())

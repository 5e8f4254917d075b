"""`python -m kvlib.grade NOTEBOOK [--json]`: grade an exercise notebook (see `kvlib.grading`)."""

import sys

from kvlib.grading import main

if __name__ == "__main__":
    sys.exit(main())

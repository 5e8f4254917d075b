"""`python -m kvlib.course.grade NOTEBOOK [--json]`: grade an exercise notebook (see
`kvlib.course.grading`)."""

import sys

from kvlib.course.grading import main

if __name__ == "__main__":
    sys.exit(main())

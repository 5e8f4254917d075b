"""`python -m kvlib.course.grade NOTEBOOK [--json]`: grade an exercise notebook (see
`kvlib.course.grader`)."""

import sys

from kvlib.course.grader import main

if __name__ == "__main__":
    sys.exit(main())

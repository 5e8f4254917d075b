"""The course machinery, kept apart from the library: what the notebooks and exercises need to run
and be graded, none of which attention or caches depend on.

- `notebook`: set-up of every chapter notebook, and refreshing stored outputs;
- `grading`, `grade`, `checks/`: graded exercises (`python -m kvlib.course.grade NOTEBOOK`), with
  `grader` (the CLI's grader), `checking` (`check()` in the notebook), `sandbox` (the learner's
  process), `confine` (what the operating system enforces and measures about it), `guards` (kvlib
  switched off and no processes while a question is graded) and `wire` (the pipe protocol);
- `bench`: timing helpers for the Measure sections, and the GPU decode benchmark;
- `viz`: plots and animations.

Library modules never import from here; the dependencies point one way.
"""

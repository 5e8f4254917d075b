"""The course machinery, kept apart from the library: what the notebooks and exercises need to run
and be graded, none of which attention or caches depend on.

- `notebook`: set-up of every chapter notebook, and refreshing stored outputs;
- `grading`, `grade`, `checks/`: graded exercises (`python -m kvlib.course.grade NOTEBOOK`), with
  `grader` (the CLI's grader), `checking` (`check()` in the notebook), `sandbox` (the learner's
  process), `guards` (blocking kvlib by provenance), `wire` (the pipe protocol) and `blocked`
  (what each question blocks);
- `bench`: timing helpers for the Measure sections, and the GPU decode benchmark;
- `viz`: plots and animations.

Library modules never import from here; the dependencies point one way.
"""

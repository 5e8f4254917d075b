"""Graded questions, one module per chapter (`chNN.py`); see `kvlib.course.grading`."""

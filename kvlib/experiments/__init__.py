"""Experiments: one module per recorded result under `results/`, each run as `python -m
kvlib.experiments.<name>`."""

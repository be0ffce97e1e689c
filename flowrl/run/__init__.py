"""A training run's lifecycle, around the algorithm: the checks made before any model loads and the
engine the run builds (checks.py), checkpoints that restore a run exactly (checkpoint.py) and how a
run starts or resumes (resume.py), metrics files, plots and grids (metrics.py), warnings about a
run that trains on nothing (health.py), Ctrl-C and SIGTERM (interrupts.py), the progress bar
(progress.py), the exported pipeline folder (export.py) and the loop that drives a trainer's steps
with all of them (loop.py). Nothing here knows an algorithm's insides: the loop calls a trainer
through the few methods it names.
"""

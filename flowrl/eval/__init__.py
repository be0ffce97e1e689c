"""Sampling with trained weights, for `flowrl eval`, `flowrl generate` and `flowrl serve`: where a
run's weights are and how they go into a loaded model (weights.py), the model ready to sample with
its settings (inference.py), the evaluation of several sets of weights on the same prompts and
seeds (evaluate.py) and its report (report.py).
"""

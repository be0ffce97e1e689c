"""Models for tests, smoke runs and speed runs, built offline: tiny random checkpoints of every
family with hand-built tokenizers (tiny*.py), and random weights at the published architectures
(architectures.py, random_weights.py). The adapters in flowrl/models know nothing of them.
"""

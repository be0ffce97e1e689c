"""Benchmarks users run: `flowrl bench rollout` (the engine against the diffusers pipeline:
throughput, MFU), `flowrl bench train` (a recipe's whole training step, phase by phase, against
its FLOP limits and a peer's loop) and `flowrl bench learn` (held-out accuracy on the toy world
against steps and device-seconds, configurations side by side with their controls).

Models are random weights at published architectures (`flowrl.bench.models`) or a local
checkpoint; FLOPs and the matmul peak come from `flowrl.run.flops` and `flowrl.run.step_flops`.
Nothing here is imported by the rest of the package.
"""

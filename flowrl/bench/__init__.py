"""Benchmarks: `flowrl bench rollout` (engine vs diffusers pipeline throughput, MFU) and
`flowrl bench logprob` (rollout-vs-trainer log-prob gap, training-step speed).

Models are random weights at published architectures (`flowrl.bench.models`) or a local
checkpoint; FLOPs and the matmul peak come from `flowrl.run.flops`. Nothing here is imported by
the rest of the package.
"""

"""Clients of a rollout server (`flowrl serve`): `RemoteEngine` has the engine's API over HTTP, so
the agent loop and the trainer drive local engines and remote servers alike; `ReplicaProcesses`
starts and stops `flowrl serve` processes for decoupled training.

Public names are imported lazily: `import flowrl.client` stays light.
"""

__all__ = [
    "RemoteEngine",
    "RemoteEngineError",
    "RemoteRequestError",
    "ReplicaProcesses",
    "ServerUnavailableError",
]


def __getattr__(name):
    if name == "RemoteEngine":
        from flowrl.client.remote_engine import RemoteEngine

        return RemoteEngine
    if name == "ReplicaProcesses":
        from flowrl.client.replicas import ReplicaProcesses

        return ReplicaProcesses
    if name in ("RemoteEngineError", "RemoteRequestError", "ServerUnavailableError"):
        from flowrl.client import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'flowrl.client' has no attribute {name!r}")

"""What a remote engine's calls raise, each naming the server.

`ServerUnavailableError` is a `ReplicaDownError`: the server could not be reached or
answered 502/503/504 after the client's bounded retries, or took longer than its timeout; a
balancer re-sends the request to another replica. `RemoteRequestError` (a ValueError) is a 4xx:
the request itself is wrong, and another server would refuse it too. `RemoteEngineError` is
anything else the server reported (a 500: the request failed on its side).
"""

from __future__ import annotations


class ReplicaDownError(RuntimeError):
    """A replica could not serve a request (unreachable, died, or failing on its side); a balancer
    (flowrl.rollout.balancer) re-sends the request to another replica."""


class RemoteEngineError(RuntimeError):
    """The server answered with an error that is neither bad input nor unavailability."""

    def __init__(self, url: str, message: str, status: int | None = None):
        self.url, self.status = url, status
        super().__init__(f"rollout server {url}: {message}")


class RemoteRequestError(ValueError):
    """The server refused the request (HTTP 4xx); its message names the field and the fix."""

    def __init__(self, url: str, status: int, message: str):
        self.url, self.status = url, status
        super().__init__(f"rollout server {url} refused the request (HTTP {status}): {message}")


class ServerUnavailableError(ReplicaDownError):
    """The server is down, unreachable, overloaded or too slow; says what was tried."""

    def __init__(self, url: str, what: str, num_attempts: int, last_error: str):
        self.url, self.num_attempts, self.last_error = url, num_attempts, last_error
        plural = "attempt" if num_attempts == 1 else "attempts"
        super().__init__(
            f"rollout server {url} is unavailable: {what} failed after {num_attempts} {plural} ({last_error}); "
            f"check that `flowrl serve` is running at {url} and reachable from here"
        )

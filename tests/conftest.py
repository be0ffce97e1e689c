"""Shared pytest setup: offline hub, session-wide tiny checkpoints, the `gpu` marker skip, rollout
servers on loopback and a check that nothing listens elsewhere."""

from __future__ import annotations

import os

# A hub id that slips into a test must fail at once instead of hanging on DNS retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory):
    """A tiny random SD3 checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("sd3", tmp_path_factory.mktemp("tiny_sd3"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_path(tmp_path_factory):
    """A tiny random Qwen-Image checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen_image", tmp_path_factory.mktemp("tiny_qwen"), seed=0)


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory):
    """A tiny random FLUX.1 [dev] checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("flux", tmp_path_factory.mktemp("tiny_flux"), seed=0)


@pytest.fixture(scope="session")
def tiny_z_image_path(tmp_path_factory):
    """A tiny random Z-Image checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("z_image", tmp_path_factory.mktemp("tiny_z_image"), seed=0)


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` when no CUDA device is present (no command-line flag needed)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def rollout_servers():
    """start(model_path, count=1, admin_token=None) -> URLs of `flowrl serve` apps (each with its
    own engine over its own copy of the model) on 127.0.0.1 in this process; stopped after the test."""
    import contextlib

    from flowrl.engine import DiffusionEngine
    from flowrl.server.http import serve_in_background
    from flowrl.server.rollout_app import create_rollout_app

    stack = contextlib.ExitStack()

    def start(model_path, count=1, admin_token=None, max_batch_rows=32):
        urls = []
        for index in range(count):
            engine = DiffusionEngine.from_pretrained(model_path, max_batch_rows=max_batch_rows)
            stack.callback(engine.shutdown)
            app = create_rollout_app(engine, f"replica{index}", admin_token=admin_token)
            urls.append(stack.enter_context(serve_in_background(app, host="127.0.0.1", port=0)))
        return urls

    with stack:
        yield start


def _process_tree(root: int) -> set[int]:
    """`root` and every process descended from it (read from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in tree]
        tree.update(children)
        frontier += children
    return tree


def listening_addresses(root: int | None = None) -> list[tuple[str, int]]:
    """(hex address, port) of every TCP socket in LISTEN state held by `root` (default: this
    process) or its descendants; the address as /proc/net/tcp{,6} writes it."""
    inodes = set()
    for pid in _process_tree(root or os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                address, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    host, port = address.split(":")
                    found.append((host, int(port, 16)))
    return found


# 127.0.0.1 as IPv4, ::1 and ::ffff:127.0.0.1 as IPv6, in /proc/net's byte order.
LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def assert_listens_on_loopback_only(root: int | None = None) -> None:
    """No socket of `root`'s process tree listens on a non-loopback address."""
    exposed = [(host, port) for host, port in listening_addresses(root) if host.upper() not in LOOPBACK_HEX]
    assert not exposed, f"listening on non-loopback addresses: {exposed}"


@pytest.fixture
def check_loopback_only():
    """check_loopback_only(root=None): assert_listens_on_loopback_only, as a fixture."""
    return assert_listens_on_loopback_only

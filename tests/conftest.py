"""Shared pytest setup: offline hub, session-wide tiny checkpoints, the `gpu` marker skip, rollout
servers on loopback, a check that nothing listens elsewhere, trainers closed after their test,
and a check that no test leaves an engine or reward thread running."""

from __future__ import annotations

import os
import threading

# A hub id that slips into a test must fail at once instead of hanging on DNS retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Under pytest-xdist (pyproject's addopts) every worker runs torch on one thread: two workers of two
# threads each would oversubscribe the two cores they share. Set before torch is imported; the
# processes a test starts (torchrun ranks, `flowrl train`) inherit it.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

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


@pytest.fixture
def build_trainer():
    """build_trainer(cfg, **kwargs) -> a FlowGRPOTrainer, closed after the test (reward workers
    joined, engine shut down) whether or not it trained."""
    from flowrl.trainer.trainer import FlowGRPOTrainer

    built = []

    def build(cfg, **kwargs):
        built.append(FlowGRPOTrainer(cfg, **kwargs))
        return built[-1]

    yield build
    for trainer in built:
        trainer.close()


# Threads flowrl starts that only a shutdown or close ends: an engine's loop, a scorer's workers.
FLOWRL_THREAD_PREFIXES = ("flowrl-engine", "reward-worker-")
_thread_started_in: dict[threading.Thread, str] = {}


def _flowrl_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.startswith(FLOWRL_THREAD_PREFIXES)}


@pytest.fixture(autouse=True)
def _note_flowrl_threads(request):
    """Remember which test each new engine / reward thread appeared in (torn down after the test's
    other fixtures, so the threads a fixture of the test closes are gone by then)."""
    before = _flowrl_threads()
    yield
    for thread in _flowrl_threads() - before:
        _thread_started_in.setdefault(thread, request.node.nodeid)


@pytest.fixture(scope="session", autouse=True)
def no_flowrl_threads_left():
    """After every test and fixture has finished: no engine or reward thread may still run (each
    test closes what it builds; a module or session fixture's engine is shut down by its
    teardown, which runs before this one). A failure names the test each thread started in."""
    yield
    started_in = {thread: _thread_started_in.get(thread, "a fixture's setup") for thread in _flowrl_threads()}
    left = sorted(f"{t.name} ({where})" for t, where in started_in.items())
    if left:
        pytest.fail(
            f"{len(left)} flowrl threads outlived their tests (close the trainer, shut the engine down): "
            + "; ".join(left),
            pytrace=False,
        )


# Test folders whose tests run on one pytest-xdist worker, one after another: folder -> group name.
SAME_WORKER_FOLDERS = {
    # The distributed tests share session runs (tests/distributed/conftest.py: one-process
    # references and torchrun launches, which would otherwise run once per worker) and start
    # process groups and a local Ray of their own.
    "tests/distributed/": "distributed",
}


class _FolderGroups:
    """xdist's `--dist=loadgroup` (pyproject's addopts) with the groups of SAME_WORKER_FOLDERS.

    Why not `xdist_group` marks: xdist 3.8 puts a test in its group by renaming the test's nodeid,
    which pytest 9.2's nodeids no longer allow, so the marks group nothing. Registered only when
    xdist is loaded (`-p no:xdist` runs without it)."""

    @pytest.hookimpl
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadGroupScheduling

        class FolderGroupScheduling(LoadGroupScheduling):
            def _split_scope(self, nodeid: str) -> str:
                for folder, group in SAME_WORKER_FOLDERS.items():
                    if nodeid.startswith(folder):
                        return group
                return nodeid  # every other test is a work unit of its own, as with --dist=load

        return FolderGroupScheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_FolderGroups(), "flowrl-folder-groups")


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

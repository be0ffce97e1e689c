"""Shared pytest setup: offline hub, session-wide tiny checkpoints, the `gpu` marker skip, rollout
servers on loopback, a check that nothing listens elsewhere, trainers closed after their test,
and a check that no test leaves an engine or reward thread running."""

from __future__ import annotations

import os
import tempfile
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
    from flowrl.models.debug.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("sd3", tmp_path_factory.mktemp("tiny_sd3"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_path(tmp_path_factory):
    """A tiny random Qwen-Image checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.debug.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen_image", tmp_path_factory.mktemp("tiny_qwen"), seed=0)


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory):
    """A tiny random FLUX.1 [dev] checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.debug.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("flux", tmp_path_factory.mktemp("tiny_flux"), seed=0)


@pytest.fixture(scope="session")
def tiny_z_image_path(tmp_path_factory):
    """A tiny random Z-Image checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.debug.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("z_image", tmp_path_factory.mktemp("tiny_z_image"), seed=0)


@pytest.fixture
def build_trainer():
    """build_trainer(cfg, **kwargs) -> a Trainer, closed after the test (reward workers
    joined, engine shut down) whether or not it trained."""
    from flowrl.trainer.trainer import Trainer

    built = []

    def build(cfg, **kwargs):
        built.append(Trainer(cfg, **kwargs))
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


# Test folders (or files) whose tests run on one pytest-xdist worker, one after another: path -> group name.
SAME_WORKER_FOLDERS = {
    # The distributed tests share session runs (tests/distributed/conftest.py: one-process
    # references and torchrun launches, which would otherwise run once per worker) and start
    # process groups and a local Ray of their own.
    "tests/distributed/": "distributed",
    # One local Ray, one engine actor and one colocated reference run for the file, not one per worker.
    "tests/rollout/test_ray_engine.py": "ray_engine",
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


# Folders of the longest tests, started first (in this order) so that the two CI workers do not end
# with one of them alone on a minutes-long test: the toy world's learning runs, then the
# distributed group (one worker, one after another).
LONGEST_FIRST = ("tests/learning/", "tests/distributed/")


def _longest_first(item) -> int:
    nodeid = item.nodeid
    return next((i for i, folder in enumerate(LONGEST_FIRST) if nodeid.startswith(folder)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    """Start the longest tests first (LONGEST_FIRST; the order is otherwise kept), and skip tests
    marked `gpu` when no CUDA device is present (no command-line flag needed)."""
    items.sort(key=_longest_first)
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


# --- a local Ray (tests/distributed/test_ray.py, tests/rollout/test_ray_engine.py) ---

# Set before Ray is imported (it reads them then): a local node on the loopback alone, offline.
LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "GLOO_SOCKET_IFNAME": "lo",
}


@pytest.fixture(scope="module")  # shut down after the file: later tests see none of Ray's sockets or threads
def local_ray():
    """A local Ray bound to 127.0.0.1 for one test file (its start costs seconds), as flowrl starts its own."""
    saved = {name: os.environ.get(name) for name in [*LOCAL_RAY_ENV, "RAY_TMPDIR"]}
    # A short folder of its own: Ray's socket paths (AF_UNIX, at most 107 bytes) would be too long
    # under pytest's tmp_path of an xdist worker (/tmp/pytest-of-USER/pytest-N/popen-gwK/...).
    ray_tmp = tempfile.TemporaryDirectory(prefix="ray", ignore_cleanup_errors=True)
    os.environ.update(LOCAL_RAY_ENV, RAY_TMPDIR=ray_tmp.name)
    import ray

    # As flowrl's own local Ray (flowrl.distributed.ray_launcher): the same quiet Ray processes.
    hook = {"worker_process_setup_hook": "flowrl.console.quiet_local_ray_worker"}
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, runtime_env=hook)
    yield ray
    ray.shutdown()
    ray_tmp.cleanup()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# --- a run's fixtures: tiny training configs and runs (the trainer, run and eval tests) ---


@pytest.fixture(scope="session")
def tiny_run_config(tiny_sd3_path):
    """tiny_run_config(output_dir, *overrides) -> a FlowRLConfig of a very small run of the tiny
    SD3 model (no tensorboard, bar, validation or checkpoints unless `overrides` ask for them);
    for fixtures of any scope."""
    from small_runs import small_run_config

    def build(output_dir, *overrides):
        return small_run_config(tiny_sd3_path, output_dir, *overrides)

    return build


@pytest.fixture
def make_cfg(tiny_run_config, tmp_path):
    """make_cfg(*overrides, output=name) -> a FlowRLConfig of a very small tiny run."""

    def build(*overrides, output: str = "run"):
        return tiny_run_config(tmp_path / output, *overrides)

    return build


@pytest.fixture
def take_rollout():
    """take_rollout(trainer, overrides=None) -> (tensors, specs): one rollout batch of the trainer's
    next step as update() receives it; overrides: per-prompt `sampling_overrides` (a list, one
    dict or None per prompt, repeated over its group)."""
    from flowrl.engine.output import TransitionSpec
    from flowrl.rollout.batch import RolloutBatch

    def take(trainer, overrides=None):
        rows = trainer.prompts.next_rows()
        for i, row in enumerate(rows):
            row["uid"] = f"u{i}"
            if overrides is not None and overrides[i]:
                row["sampling_overrides"] = dict(overrides[i])
        batch = RolloutBatch.from_rows(rows).repeat(trainer.cfg.rollout.n)
        out = trainer.agent_loop.generate_sequences(batch)
        tensors = {k: v for k, v in out.batch.items() if k != "images"}
        return tensors, TransitionSpec.from_columns(out.non_tensor_batch)

    return take


def train_tiny_lora_run(model_path, out, *overrides):
    """Train a 2-step LoRA run of the tiny SD3 model at `out` (checkpoints at steps 1 and 2,
    validation at steps 0 and 2); returns the run with the validation images it produced, by
    step: what flowrl eval and flowrl generate must reproduce."""
    from types import SimpleNamespace

    from flowrl.run.config import load_train_config
    from flowrl.trainer.trainer import Trainer

    cfg = load_train_config(
        None,
        [
            f"model.path={model_path}",
            f"trainer.output_dir={out}",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "trainer.total_steps=2",
            "trainer.val_every=2",
            "trainer.save_every=1",
            "trainer.lora.enabled=true",
            "trainer.prompts_per_step=2",
            "trainer.num_val_images=3",
            "rollout.n=4",
            *overrides,
        ],
    )
    trainer = Trainer(cfg)
    validation_images = {}
    generate_sequences = trainer.agent_loop.generate_sequences

    def recording(batch, validation=False, **kwargs):
        result = generate_sequences(batch, validation=validation, **kwargs)
        if validation:
            validation_images[trainer.step] = result.batch["images"].clone()
        return result

    trainer.agent_loop.generate_sequences = recording
    with trainer:
        trainer.fit()
    prompts = [row["raw_prompt"] for row in trainer.val_rows]
    return SimpleNamespace(dir=out, model=model_path, validation_images=validation_images, val_prompts=prompts)


@pytest.fixture(scope="session")
def tiny_lora_run(tiny_sd3_path, tmp_path_factory):
    """A finished tiny LoRA run on CPU (train_tiny_lora_run)."""
    return train_tiny_lora_run(tiny_sd3_path, tmp_path_factory.mktemp("tiny_lora_run"))


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any attempt to load a model fails the test: the error must come first."""
    from flowrl.engine.engine import DiffusionEngine

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(DiffusionEngine, "from_pretrained", classmethod(lambda cls, *a, **k: refuse()))

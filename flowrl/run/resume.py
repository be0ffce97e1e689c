"""How a run starts: from a verified checkpoint, fresh in a folder of its own, or not at all.

`plan_run(cfg)` decides before any model loads, from `trainer.resume`, `trainer.overwrite` and
what `trainer.output_dir` holds:

- resume from the newest verified checkpoint (`trainer.resume=auto`) or the one named
  (`trainer.resume=PATH`), after comparing its saved config with this one (`RESUME_RULES`);
- start fresh, in a folder that holds no other run's files (`RUN_FILES`), or after deleting
  exactly those files when `trainer.overwrite=true`; any other new run in a used folder is refused,
  so one folder never mixes the metrics, checkpoints and weights of two runs;
- a run stopped by Ctrl-C / SIGTERM keeps a checkpoint of its last completed step (resumed as
  above); one stopped before any step completed removes the files it wrote, so its folder is a
  fresh start again (flowrl.trainer.trainer.Trainer.fit);
- start again, deleting exactly those files, when the folder holds no checkpoint at all and its
  files were written by an earlier start of the same config (`RUN_CONFIG`, written when a run
  starts): a run that crashed before its first checkpoint is restarted by the same command;
- do nothing when the run is already finished (its checkpoint is at `trainer.total_steps` or its
  epochs are done, or `final/` is written and metrics.jsonl reached `total_steps`).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from flowrl.run import checkpoint
from flowrl.run.metrics import METRICS_FILE, TENSORBOARD_DIR, read_metrics

# The config of the run that started in trainer.output_dir (RunPlan.start writes it).
RUN_CONFIG = "run_config.json"
# What a run writes in trainer.output_dir; `trainer.overwrite=true` deletes these and nothing else.
RUN_FILES = (
    METRICS_FILE,
    checkpoint.CHECKPOINTS_DIR,
    "final",
    TENSORBOARD_DIR,
    "val",
    "reward_curve.png",
    RUN_CONFIG,
)

NEW = "new"  # the new value applies, reported
QUIET = "quiet"  # the new value applies, not reported (it is about this invocation)
REFUSE = "refuse"  # the checkpoint would mean something else: resuming is refused

# Which config keys may change on resume. A key ending in "." covers every key under it; the
# longest matching entry wins (a test checks that every config key has one).
RESUME_RULES: tuple[tuple[str, str], ...] = (
    ("model.", REFUSE),  # which network the weights belong to
    ("model.device", NEW),  # where it runs, not what it is
    ("engine.", NEW),  # batching and compilation: speed and memory
    ("rollout.", NEW),  # rollout seeds, batching, validation sampling
    ("rollout.n", REFUSE),  # the group size: advantages and the data position per step
    ("rollout.sampling.", REFUSE),  # the policy's transition distribution
    ("algorithm.", REFUSE),  # the objective the optimizer state was built for
    ("trainer.", NEW),  # steps, optimizer hyper-parameters (applied to the restored optimizer), schedules, folders
    ("trainer.lora.", REFUSE),  # the trained parameters themselves
    ("trainer.prompts_per_step", REFUSE),  # the data position per step
    ("trainer.seed", REFUSE),  # the data order the saved position indexes
    ("trainer.resume", QUIET),
    ("trainer.overwrite", QUIET),
    ("reward.", NEW),  # what is scored from now on
    ("data.", REFUSE),  # the dataset the saved position indexes
    ("logging.", NEW),
    ("distributed.", NEW),  # how many processes train: any world size resumes any checkpoint
)
_SECRET_KEYS = ("token",)


def resume_rule(key: str) -> str:
    """The RESUME_RULES rule of a dotted config key (REFUSE for a key no entry covers)."""
    matches = [p for p, _ in RESUME_RULES if key == p or (p.endswith(".") and key.startswith(p))]
    return dict(RESUME_RULES)[max(matches, key=len)] if matches else REFUSE


def flatten(config: dict, prefix: str = "") -> dict:
    """Nested config dict -> {dotted key: leaf value} (lists stay whole)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _show(key: str, value) -> str:
    return "***" if key.rpartition(".")[2] in _SECRET_KEYS else repr(value)


def config_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, current value) for every key both configs have and that differs."""
    old, new = flatten(saved), flatten(current)
    return [(key, old[key], new[key]) for key in sorted(old.keys() & new.keys()) if old[key] != new[key]]


def check_config_changes(saved: dict, current: dict, where: Path) -> str | None:
    """Apply RESUME_RULES: ValueError listing every refused change; else the one line reporting
    the changes that apply (None when nothing reportable changed)."""
    changes = config_changes(saved, current)
    refused = [c for c in changes if resume_rule(c[0]) == REFUSE]
    if refused:
        listed = ", ".join(f"{k} ({_show(k, a)} -> {_show(k, b)})" for k, a, b in refused)
        raise ValueError(
            f"cannot resume {where}: {listed} would change what the checkpoint means; revert "
            "(the checkpoint's values are in its state.json), or start a new run with "
            "trainer.resume=never in a new trainer.output_dir"
        )
    reported = [f"{k}: {_show(k, a)} -> {_show(k, b)}" for k, a, b in changes if resume_rule(k) == NEW]
    if not reported:
        return None
    return f"resuming {where} with config changes (the new values apply): {', '.join(reported)}"


@dataclass
class RunPlan:
    """What `plan_run` decided: resume `checkpoint` (None: fresh start), or nothing to do."""

    checkpoint: Path | None = None
    step: int = 0
    finished: str | None = None  # the line to print when there is nothing to do
    report: list[str] = field(default_factory=list)  # lines to print when the run starts
    delete: list[str] = field(default_factory=list)  # RUN_FILES to delete first
    delete_reason: str = "trainer.overwrite=true"  # why, in the line that lists them

    def start(self, output_dir: str | Path, config_dict: dict | None = None) -> None:
        """Carry out the plan's side effects (delete for overwrite or a restart, print the report)
        and record the run's config (`RUN_CONFIG`) for a restart after a crash."""
        delete_run_files(output_dir, self.delete, self.delete_reason)
        for line in self.report:
            print(line, flush=True)
        if config_dict is not None and not self.finished:
            (Path(output_dir) / RUN_CONFIG).write_text(json.dumps({"config": config_dict}, indent=1))


def run_files(output_dir: str | Path) -> list[str]:
    """The RUN_FILES present in output_dir."""
    folder = Path(output_dir)
    return [name for name in RUN_FILES if (folder / name).exists()]


def delete_run_files(output_dir: str | Path, names: list[str], reason: str = "trainer.overwrite=true") -> None:
    """Delete the RUN_FILES `names` from output_dir; one line on stderr says why (`reason`) and what."""
    folder = Path(output_dir)
    listed = _listing(folder, names)
    for name in names:
        path = folder / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    if names:
        print(f"{reason}: deleted {listed} from {folder}", file=sys.stderr, flush=True)


def _listing(output_dir: Path, names: list[str]) -> str:
    return ", ".join(name + ("/" if (output_dir / name).is_dir() else "") for name in names)


def _used_folder_error(tcfg, used: list[str]) -> ValueError:
    listed = _listing(Path(tcfg.output_dir), used)
    head = f"trainer.output_dir={tcfg.output_dir!r} holds another run's files ({listed})"
    if tcfg.resume == "never":
        choices = "resume it with trainer.resume=auto, pick a new trainer.output_dir"
    else:
        head += " but no checkpoint that can be resumed"
        choices = "pick a new trainer.output_dir"
    return ValueError(f"{head}; {choices}, or set trainer.overwrite=true to delete those files and start clean")


def _is_restart_of_same_config(output_dir: Path, config_dict: dict) -> bool:
    """Whether output_dir holds no checkpoint folder at all and its RUN_CONFIG is this config (keys
    about this invocation alone, RESUME_RULES' QUIET ones, aside): an earlier start of the same
    command that stopped before its first checkpoint."""
    if checkpoint.checkpoint_dirs(output_dir):  # even damaged ones: never deleted unasked
        return False
    try:
        saved = json.loads((output_dir / RUN_CONFIG).read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(saved, dict):
        return False

    def meaningful(config: dict) -> dict:
        return {k: v for k, v in flatten(config).items() if resume_rule(k) != QUIET}

    return meaningful(saved) == meaningful(config_dict)


def _finished_line(output_dir, step: int, why: str) -> str:
    return (
        f"nothing to do: the run in {output_dir} is finished at step {step} ({why}); raise "
        "trainer.total_steps to train on, or pick a new trainer.output_dir for a new run"
    )


def _finished_by_final_weights(tcfg) -> str | None:
    """The finished line when final/ is written and metrics.jsonl reached trainer.total_steps."""
    out = Path(tcfg.output_dir)
    if not (out / "final").is_dir():
        return None
    # warn=False: a resumed run's logger repairs a torn last line and says so
    logged = [record["step"] for record in read_metrics(out / METRICS_FILE, warn=False)]
    if not logged or max(logged) < tcfg.total_steps:
        return None
    return _finished_line(out, max(logged), f"trainer.total_steps={tcfg.total_steps}")


def plan_run(cfg, config_dict: dict) -> RunPlan:
    """Decide how the run starts (see the module docstring); ValueError for a folder or resume
    that cannot be used, naming the folder or file and the choices."""
    tcfg = cfg.trainer
    out = Path(tcfg.output_dir)
    if tcfg.overwrite:
        if tcfg.resume not in ("auto", "never"):
            raise ValueError(
                f"trainer.overwrite=true starts a new run but trainer.resume={tcfg.resume!r} names a checkpoint "
                "to continue; drop one of the two"
            )
        return RunPlan(delete=run_files(out))
    found = checkpoint.find_resume_checkpoint(tcfg.resume, out)
    if found is None:
        used = run_files(out)
        if not used or used == [RUN_CONFIG]:  # at most a start that wrote nothing else: nothing to keep
            return RunPlan()
        finished = _finished_by_final_weights(tcfg) if tcfg.resume == "auto" else None
        if finished:
            return RunPlan(finished=finished)
        if _is_restart_of_same_config(out, config_dict):
            reason = (
                "no checkpoint to resume: an earlier start of this same config stopped before its first one; restarting"
            )
            return RunPlan(delete=used, delete_reason=reason)
        raise _used_folder_error(tcfg, used)
    if out.resolve() not in found.resolve().parents and run_files(out):
        raise ValueError(
            f"trainer.resume={tcfg.resume!r} continues that run into trainer.output_dir={tcfg.output_dir!r}, "
            f"which holds another run's files ({_listing(out, run_files(out))}); pick a new (empty) trainer.output_dir"
        )
    state = checkpoint.read_checkpoint_state(found)
    plan = RunPlan(checkpoint=found, step=int(state["step"]))
    if state.get("config") is None:
        plan.report.append(f"warning: {found} has no saved config, so config changes cannot be checked")
    else:
        line = check_config_changes(state["config"], config_dict, found)
        if line:
            plan.report.append(line)
    epoch = state.get("trainer", {}).get("data", {}).get("epoch", 0)
    if plan.step >= tcfg.total_steps:
        plan.finished = _finished_line(out, plan.step, f"trainer.total_steps={tcfg.total_steps}")
    elif tcfg.epochs is not None and epoch >= tcfg.epochs:
        plan.finished = _finished_line(out, plan.step, f"trainer.epochs={tcfg.epochs} done")
    else:  # the last steps may be past the last checkpoint (total_steps not a multiple of save_every)
        plan.finished = _finished_by_final_weights(tcfg)
    return plan

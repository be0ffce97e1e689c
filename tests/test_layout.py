"""The package's import rules, read from the source with the standard library (nothing imported):

- each package imports only the packages before it in ORDER (the layout of the architecture page);
- no import cycle among flowrl's modules (module-level imports; an import inside a function is
  lazy and cannot form a cycle at import time, so it is left out here, but rules below count it);
- the core (config, sampler, models, engine, rollout, trainer) reaches the fast paths only through
  flowrl.accel's entry (`from flowrl.accel import compile_adapter, is_compiled`), and the model
  adapters not at all: flowrl/models holds no kernels and no compile machinery;
- config imports nothing of models, engine or accel (it only describes and checks settings);
- the core never imports flowrl.bench.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flowrl"
CORE = (
    "flowrl.config",
    "flowrl.sampler",
    "flowrl.sampling_params",
    "flowrl.models",
    "flowrl.engine",
    "flowrl.rollout",
    "flowrl.trainer",
)
ACCEL_ENTRY = {"compile_adapter", "is_compiled", "merged_lora"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _imports(name: str, module_level_only: bool) -> list[tuple[str, tuple[str, ...], int]]:
    """(imported module, names taken from it, line) for every import statement of module `name`;
    with `module_level_only`, not those inside function bodies."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, (), child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package, up level - 1
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                found.append((base, tuple(alias.name for alias in child.names), child.lineno))
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def _targets(imported: str, names: tuple[str, ...]) -> set[str]:
    """The flowrl modules an import statement executes (not counting parent packages' inits):
    the module itself, and each imported name that is a submodule."""
    targets = {imported} if imported in MODULES else set()
    targets |= {f"{imported}.{n}" for n in names if f"{imported}.{n}" in MODULES}
    return targets


def test_no_import_cycle():
    edges = {m: set() for m in MODULES}
    for module in MODULES:
        for imported, names, _ in _imports(module, module_level_only=True):
            edges[module] |= _targets(imported, names) - {module}
    # Depth-first search; a grey node met again closes a cycle.
    state, stack, cycles = {}, [], []

    def walk(node):
        state[node] = "grey"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "grey":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = "black"

    for module in sorted(MODULES):
        if module not in state:
            walk(module)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_core_reaches_the_fast_paths_only_through_the_entry():
    bad = []
    for module in MODULES:
        if not any(_within(module, core) for core in CORE):
            continue
        for imported, names, line in _imports(module, module_level_only=False):
            if not _within(imported, "flowrl.accel"):
                continue
            entry_only = imported == "flowrl.accel" and set(names) <= ACCEL_ENTRY
            if not entry_only or _within(module, "flowrl.models"):
                bad.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {imported} {names or ''}")
    assert not bad, "\n".join(bad)


def test_models_hold_no_kernels_or_compile_machinery():
    bad = []
    for module in MODULES:
        if _within(module, "flowrl.models"):
            for imported, _, line in _imports(module, module_level_only=False):
                if imported.split(".")[0] == "triton" or _within(imported, "torch._inductor"):
                    bad.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {imported}")
    assert not bad, "\n".join(bad)


def test_config_imports_nothing_of_models_engine_or_accel():
    bad = []
    for module in MODULES:
        if not _within(module, "flowrl.config"):
            continue
        for imported, names, line in _imports(module, module_level_only=False):
            for target in _targets(imported, names) or {imported}:
                if any(_within(target, p) for p in ("flowrl.models", "flowrl.engine", "flowrl.accel")):
                    bad.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_core_never_imports_the_benchmarks():
    """flowrl.bench builds on the core (random weights live in flowrl.models.debug.random_weights so that
    the trainer can take them); the core never reaches back into the benchmarks."""
    bad = []
    for module in MODULES:
        if any(_within(module, core) for core in CORE):
            for imported, names, line in _imports(module, module_level_only=False):
                if any(_within(target, "flowrl.bench") for target in _targets(imported, names) or {imported}):
                    bad.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {imported}")
    assert not bad, "\n".join(bad)


# The package order of docs/ARCHITECTURE's layout: each package imports only those before it (or
# itself). Top-level modules count as packages of their own.
ORDER = (
    "sampling_params",
    "console",
    "output_paths",
    "waiting",
    "config",
    "sampler",
    "data",
    "models",
    "accel",
    "rewards",
    "engine",
    "server",
    "distributed",
    "client",
    "run",
    "rollout",
    "trainer",
    "eval",
    "bench",
    "cli",
)


def _package(module: str) -> str | None:
    """The ORDER entry a flowrl module belongs to (None: the package's own __init__ / __main__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] not in ("__main__",) else None


def test_every_package_imports_only_those_before_it():
    """No arrow runs up the order: an import inside a function counts too (it is a call upward all
    the same), so a package's callers are always above it."""
    rank = {name: index for index, name in enumerate(ORDER)}
    unknown = sorted({_package(m) for m in MODULES} - set(ORDER) - {None})
    assert not unknown, f"packages missing from ORDER (place them in the layout): {unknown}"
    upward = []
    for module in MODULES:
        mine = _package(module)
        if mine is None:
            continue
        for imported, names, line in _imports(module, module_level_only=False):
            for target in _targets(imported, names) or ({imported} if imported.startswith("flowrl.") else set()):
                theirs = _package(target)
                if theirs is not None and rank[theirs] > rank[mine]:
                    upward.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} ({mine}) imports {target}")
    assert not upward, "imports up the package order:\n" + "\n".join(upward)

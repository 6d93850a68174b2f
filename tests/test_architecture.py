"""The house rules, checked on the source (AST), not taken on trust (docs/ARCHITECTURE.md):
sub-packages in one order of layers, no import cycle, short modules and functions, and every
read of a file ddpflow did not just write, every write where the user names the place and
every string made for an interpreter going through its one boundary module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

SRC = REPO / "src" / "ddpflow"
# lower first: a module may import its own package and the ones before it, never later ones
LAYERS = ("core", "config", "seams", "data", "tracking", "results", "engine", "launch",
          "inference", "sweeps", "cli")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(SRC.rglob("*.py")):
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(name: str, path: Path, modules) -> set[str]:
    """Every ddpflow module `name` imports, at the top or inside a function: `from P import
    m` counts as an import of module P.m where that is a module, else of P itself."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if base == "ddpflow" or base.startswith("ddpflow."):
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ddpflow"))
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {d for d in _imports(m, p, mods) if d in mods and d != m}
            for m, p in mods.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # ddpflow itself (__version__): below everything
        return -1
    top = parts[1]
    return LAYERS.index("cli") if top == "__main__" else LAYERS.index(top)


def test_every_module_is_in_a_known_layer():
    for m in _modules():
        assert len(m.split(".")) == 1 or m.split(".")[1] in LAYERS + ("__main__",), (
            f"{m}: a new top-level module or package; add it to LAYERS and ARCHITECTURE.md")


def test_imports_run_one_way_between_layers():
    wrong = []
    for m, deps in _graph().items():
        for d in deps:
            if _layer(d) > _layer(m) and d != "ddpflow":
                wrong.append(f"{m} imports {d} (a higher layer)")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = _graph()
    # Tarjan's strongly connected components: any component of two or more is a cycle
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_modules_and_functions_are_short():
    long_modules, long_functions = [], []
    for m, path in _modules().items():
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            long_modules.append(f"{m}: {n} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{m}.{node.name}: {length} lines")
    assert not long_modules and not long_functions, long_modules + long_functions


def _calls(path: Path):
    """(dotted callee name, call node) for every call in a file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f, parts = node.func, []
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                parts.append(f.id)
            yield ".".join(reversed(parts)), node


def _writes_text(node: ast.Call) -> bool:
    """open(..., "w"/"a"/"x"...) with a literal mode that writes."""
    mode = node.args[1] if len(node.args) > 1 else next(
        (k.value for k in node.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(
        c in mode.value for c in "wax+")


# Each boundary, the calls only its module may make, and the few other places that may make
# them with the reason (none of them on a path a user named).
BOUNDARIES = {
    "reading (core/reading.py)": {
        "module": "core/reading.py",
        "calls": ("json.load", "json.loads"),
        "allowed": {
            "config/yamlfile.py": "the config file itself: read strictly by its own reader",
            "launch/agent.py": "a job handed over a pipe by this very launcher",
        },
    },
    "writing (core/writing.py)": {
        "module": "core/writing.py",
        "calls": ("shutil.rmtree", "os.replace", "os.rename"),
        "allowed": {
            "engine/checkpoint.py": "checkpoints of ddpflow's own stage folder (keep-last, "
                                    "atomic rename of its own temp files)",
        },
    },
    "quoting (core/quoting.py)": {
        "module": "core/quoting.py",
        "calls": ("csv.writer", "csv.DictWriter", "html.escape", "shlex.quote", "shlex.join"),
        "allowed": {},
    },
}


@pytest.mark.parametrize("name", sorted(BOUNDARIES))
def test_every_surface_goes_through_its_boundary(name):
    rule = BOUNDARIES[name]
    assert (SRC / rule["module"]).is_file(), f"{rule['module']} is missing"
    outside = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel == rule["module"] or rel in rule["allowed"]:
            continue
        for callee, node in _calls(path):
            if callee in rule["calls"]:
                outside.append(f"{rel}:{node.lineno} {callee}")
    assert not outside, f"{name}: calls outside the boundary:\n" + "\n".join(outside)


def test_files_are_written_through_the_writing_boundary():
    """No open(..., 'w') and no Path.write_text/write_bytes outside core/writing.py (and the
    streaming writers that build inside a folder the writing boundary made)."""
    streaming = {  # files written a part at a time into a place ddpflow made, and why
        "engine/checkpoint.py": "a checkpoint's temp file, hashed, fsynced and renamed",
        "data/shards.py": "JPEG shards inside prepare's .partial folder (build_folder)",
        "results/metrics.py": "metrics.jsonl appended a line per log interval, in the stage folder",
        "tracking/mlflowrun.py": "the unsent-log lines, appended in the stage folder",
        "launch/procs.py": "the pipe to the warm torchrun agent",
        "engine/runtime.py": "a test's per-rank trace file (DDPFLOW_TRACE), appended",
        "core/teelog.py": "a job's log as its output comes (what `> log 2>&1` would write)",
    }
    outside = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel == "core/writing.py" or rel in streaming:
            continue
        for callee, node in _calls(path):
            if (callee == "open" and _writes_text(node)) or callee.endswith(
                    (".write_text", ".write_bytes")):
                outside.append(f"{rel}:{node.lineno} {callee}")
    assert not outside, "writes outside core/writing.py:\n" + "\n".join(outside)


def test_the_trainer_collaborators_take_no_trainer():
    """validation, saver, stagelog, earlystop and layout get what they need as arguments:
    none of their functions takes a parameter named t/trainer (the old shared bag)."""
    for name in ("validation", "saver", "stagelog", "earlystop", "layout", "build", "step"):
        tree = ast.parse((SRC / "engine" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [a.arg for a in node.args.args + node.args.kwonlyargs]
                assert not {"t", "trainer"} & set(args), f"engine/{name}.py {node.name}{args}"


def test_user_code_is_reached_only_through_the_three_seams():
    """load_callable (the user's `package.module:callable`) is called by the model builder,
    task and dataset factory seams alone; each of them runs its result through
    seams/contract.py."""
    seams = {"seams/models.py", "seams/tasks.py", "data/factory.py"}
    callers = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel != "seams/userimport.py" and any(
                callee.endswith("load_callable") for callee, _ in _calls(path)):
            callers.add(rel)
    assert callers == seams, callers
    for rel in seams:
        assert "contract" in (SRC / rel).read_text(), f"{rel} does not use seams/contract.py"

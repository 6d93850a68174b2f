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


def _modules(src: Path = SRC) -> dict[str, Path]:
    """Every module under `src` (the ddpflow package folder) by its dotted name."""
    out = {}
    for f in sorted(src.rglob("*.py")):
        out[_module_name(f, src)] = f
    return out


def _module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, name: str, is_pkg: bool) -> str:
    """The module a `from ... import` in module `name` imports from, relative levels resolved."""
    base = node.module or ""
    if node.level:
        pkg = name.split(".") if is_pkg else name.split(".")[:-1]
        base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
    return base


def _imports(name: str, path: Path, modules) -> set[str]:
    """Every ddpflow module `name` imports, at the top or inside a function: `from P import
    m` counts as an import of module P.m where that is a module, else of P itself."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, is_pkg)
            if base == "ddpflow" or base.startswith("ddpflow."):
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ddpflow"))
    return found


def _graph(src: Path = SRC) -> dict[str, set[str]]:
    mods = _modules(src)
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


def _aliases(tree: ast.Module, name: str, is_pkg: bool) -> dict[str, set[str]]:
    """What each name an import binds stands for, anywhere in the file: `import shutil as sh`
    binds sh to shutil, `from os import replace as r` r to os.replace, `from . import x` (in
    ddpflow.seams) x to ddpflow.seams.x; `import os.path` binds os. A name bound by two
    imports stands for both (every reading is checked)."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                out.setdefault(local, set()).add(a.name if a.asname else local)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, is_pkg)
            for a in node.names:
                if a.name != "*":
                    out.setdefault(a.asname or a.name, set()).add(f"{base}.{a.name}")
    return out


def _is_getattr(node: ast.AST) -> bool:
    """getattr(X, "constant"): X's attribute under a name the reader can see."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))


def _resolve(node: ast.AST, aliases: dict[str, set[str]]) -> set[str]:
    """The canonical dotted names an expression may stand for: imports resolved, getattr
    with a constant name read as the attribute; any other base (a call, a subscript, a
    string) is "?" (so `Path(p).write_text` is "?.write_text")."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, {node.id})
    if isinstance(node, ast.Attribute):
        return {f"{b}.{node.attr}" for b in _resolve(node.value, aliases)}
    if _is_getattr(node):
        return {f"{b}.{node.args[1].value}" for b in _resolve(node.args[0], aliases)}
    return {"?"}


def _calls(path: Path, src: Path = SRC):
    """(canonical callee name, call node) for every call in a file; a callee with two
    readings (a name two imports bind) comes once for each. getattr(X, "name") counts as a
    call of X.name (the only reason to fetch it)."""
    tree = ast.parse(path.read_text())
    aliases = _aliases(tree, _module_name(path, src), path.name == "__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            names = _resolve(node.func, aliases)
            if _is_getattr(node):
                names |= _resolve(node, aliases)
            for callee in sorted(names):
                yield callee, node


def _uses(path: Path, src: Path = SRC):
    """(canonical name, node) for every name, attribute and getattr in a file, called or not:
    `f = sh.rmtree` and `map(os.replace, ...)` use the callable as much as a call does."""
    tree = ast.parse(path.read_text())
    aliases = _aliases(tree, _module_name(path, src), path.name == "__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) or _is_getattr(node):
            for name in sorted(_resolve(node, aliases)):
                yield name, node


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


def _outside_boundary(name: str, src: Path = SRC) -> list[str]:
    """'file:line name' for each use of a boundary's calls outside its module (and the
    allowed places), every import alias resolved."""
    rule = BOUNDARIES[name]
    assert (src / rule["module"]).is_file(), f"{rule['module']} is missing"
    outside = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel == rule["module"] or rel in rule["allowed"]:
            continue
        for used, node in _uses(path, src):
            if used in rule["calls"]:
                outside.append(f"{rel}:{node.lineno} {used}")
    return sorted(set(outside))


@pytest.mark.parametrize("name", sorted(BOUNDARIES))
def test_every_surface_goes_through_its_boundary(name):
    outside = _outside_boundary(name)
    assert not outside, f"{name}: calls outside the boundary:\n" + "\n".join(outside)


# files written a part at a time into a place ddpflow made, and why
STREAMING = {
    "engine/checkpoint.py": "a checkpoint's temp file, hashed, fsynced and renamed",
    "data/shards.py": "JPEG shards inside prepare's .partial folder (build_folder)",
    "results/metrics.py": "metrics.jsonl appended a line per log interval, in the stage folder",
    "tracking/mlflowrun.py": "the unsent-log lines, appended in the stage folder",
    "launch/procs.py": "the pipe to the warm torchrun agent",
    "engine/runtime.py": "a test's per-rank trace file (DDPFLOW_TRACE), appended",
    "core/teelog.py": "a job's log as its output comes (what `> log 2>&1` would write)",
}
OPENS = ("open", "io.open", "builtins.open", "os.fdopen")


def _writes_outside(src: Path = SRC) -> list[str]:
    outside = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel == "core/writing.py" or rel in STREAMING:
            continue
        for callee, node in _calls(path, src):
            if (callee in OPENS and _writes_text(node)) or callee.endswith(
                    (".write_text", ".write_bytes")):
                outside.append(f"{rel}:{node.lineno} {callee}")
    return sorted(set(outside))


def test_files_are_written_through_the_writing_boundary():
    """No open(..., 'w') and no Path.write_text/write_bytes outside core/writing.py (and the
    streaming writers that build inside a folder the writing boundary made)."""
    outside = _writes_outside()
    assert not outside, "writes outside core/writing.py:\n" + "\n".join(outside)


def test_the_trainer_collaborators_take_no_trainer():
    """The trainer's components and collaborators get what they need as arguments:
    none of their functions takes a parameter named t/trainer (the old shared bag)."""
    for name in ("validation", "checkpointer", "intervals", "stopcontrol", "settings",
                 "efficiency", "stagelog", "earlystop", "layout", "build", "step"):
        tree = ast.parse((SRC / "engine" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [a.arg for a in node.args.args + node.args.kwonlyargs]
                assert not {"t", "trainer"} & set(args), f"engine/{name}.py {node.name}{args}"


SEAMS = ("seams/models.py", "seams/tasks.py", "data/factory.py", "seams/sampleweights.py")
LOAD_CALLABLE = "ddpflow.seams.userimport.load_callable"
CONTRACT = "ddpflow.seams.contract"


def _seam_faults(src: Path = SRC) -> list[str]:
    """What breaks the rule that load_callable is called by the seams alone and that
    each of them calls a function of seams/contract.py (a call, resolved through its
    imports, of a function contract.py defines; a word in a comment is not a call)."""
    faults = []
    callers = set()
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel != "seams/userimport.py" and any(
                callee == LOAD_CALLABLE for callee, _ in _calls(path, src)):
            callers.add(rel)
    if callers != set(SEAMS):
        faults.append(f"load_callable is called by {sorted(callers)}, not {sorted(SEAMS)}")
    tree = ast.parse((src / "seams" / "contract.py").read_text())
    defined = {f"{CONTRACT}.{n.name}" for n in tree.body if isinstance(n, ast.FunctionDef)}
    for rel in SEAMS:
        if not any(callee in defined for callee, _ in _calls(src / rel, src)):
            faults.append(f"{rel} calls no function of seams/contract.py")
    return faults


def test_user_code_is_reached_only_through_the_seams():
    """load_callable (the user's `package.module:callable`) is called by the model builder,
    task and dataset factory seams alone; each of them runs its result through
    seams/contract.py."""
    faults = _seam_faults()
    assert not faults, "\n".join(faults)


PLANTED = {  # a small ddpflow tree: each file breaks a rule in a way a literal reading misses
    "core/reading.py": "", "core/writing.py": "", "core/quoting.py": "",
    "seams/userimport.py": "def load_callable(spec, setting):\n    return spec\n",
    "seams/contract.py": "def check_model(m):\n    return m\n\n\n"
                         "def check_items(ds):\n    return ds\n\n\n"
                         "def describe(x):\n    return x\n",
    # a real call through `from .contract import ...`: passes
    "seams/models.py": "from .contract import check_model as checked\n"
                       "from ddpflow.seams.userimport import load_callable\n"
                       "checked(load_callable('a:b', 'model.name'))\n",
    # the word only in a comment, and a call of a function contract.py does not define
    "seams/tasks.py": "from ddpflow.seams import contract\n"
                      "from ddpflow.seams import userimport as ui\n"
                      "# every task goes through contract.check_task\n"
                      "contract.check_task(ui.load_callable('a:b', 'task.name'))\n",
    "data/factory.py": "import ddpflow.seams.userimport\n"
                       "from ddpflow.seams import contract as c\n"
                       "c.check_items(ddpflow.seams.userimport.load_callable('a:b', 'x'))\n",
    "seams/sampleweights.py": "from ddpflow.seams.contract import describe\n"
                              "from ddpflow.seams.userimport import load_callable\n"
                              "describe(load_callable('a:b', 'data.sample_weights'))\n",
    # load_callable from a fifth place, through getattr
    "engine/sneak.py": "from ddpflow.seams import userimport\n"
                       "getattr(userimport, 'load_callable')('a:b', 'x')\n",
    "engine/alias.py": "import shutil as sh\n\n\ndef f(x):\n    sh.rmtree(x)\n",
    "engine/fromos.py": "def f(a, b):\n    from os import replace\n    replace(a, b)\n",
    "engine/fromshutil.py": "from shutil import rmtree\nhandler = rmtree\n",
    "engine/attr.py": "import os\nimport shutil\ngetattr(shutil, 'rmtree')('x')\n"
                      "getattr(os, 'rename')\n",
    "engine/renamed.py": "from os import rename as mv\nmv('a', 'b')\n",
    "engine/json.py": "from json import loads as parse\nimport json as j\nparse('1')\n"
                      "j.load(open('f'))\n",
    "engine/quote.py": "import csv as c\nfrom html import escape\nfrom shlex import quote as q\n"
                       "c.writer(None)\nescape('x')\nq('x')\n",
    "engine/write.py": "import io\nfrom pathlib import Path\nio.open('f', 'w')\n"
                       "Path('f').write_text('x')\n",
    # not a use: a string's replace
    "engine/clean.py": "def f(s):\n    return s.replace('a', 'b')\n",
}


def test_the_rules_see_through_aliases(tmp_path):
    src = tmp_path / "ddpflow"
    for rel, text in PLANTED.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    found = {name: _outside_boundary(name, src) for name in BOUNDARIES}
    assert found["writing (core/writing.py)"] == [
        "engine/alias.py:5 shutil.rmtree", "engine/attr.py:3 shutil.rmtree",
        "engine/attr.py:4 os.rename", "engine/fromos.py:3 os.replace",
        "engine/fromshutil.py:2 shutil.rmtree", "engine/renamed.py:2 os.rename"]
    assert found["reading (core/reading.py)"] == [
        "engine/json.py:3 json.loads", "engine/json.py:4 json.load"]
    assert found["quoting (core/quoting.py)"] == [
        "engine/quote.py:4 csv.writer", "engine/quote.py:5 html.escape",
        "engine/quote.py:6 shlex.quote"]
    assert _writes_outside(src) == ["engine/write.py:3 io.open", "engine/write.py:4 ?.write_text"]
    assert _seam_faults(src) == [
        "load_callable is called by ['data/factory.py', 'engine/sneak.py', 'seams/models.py', "
        "'seams/sampleweights.py', 'seams/tasks.py'], not ['data/factory.py', "
        "'seams/models.py', 'seams/sampleweights.py', 'seams/tasks.py']",
        "seams/tasks.py calls no function of seams/contract.py"]
    from_os_path = "from os import path as p\np.join('a')\n"
    (src / "engine" / "ospath.py").write_text(from_os_path)
    assert [c for c, _ in _calls(src / "engine" / "ospath.py", src)] == ["os.path.join"]

"""Mutation testing of the functions that decide results (`make mutate`; not part of `make test`).

For each target (a module, the functions in it that decide, the fast tests that claim them)
every mutant of those functions is tried one at a time: a comparison flipped to its
neighbour or negation, `and` <-> `or`, a `not` removed, an integer constant +1 / -1,
`True` <-> `False`, `min` <-> `max`, `return X` -> `return None`. The target's tests run
on the mutant; a failure kills it, a pass is a survivor: a behaviour no test pins.

Mutants are never written into the working tree (other people test the same checkout at the
same time): the package is copied to a scratch folder, the mutant is written there and the
tests run with that copy first on PYTHONPATH (the editable install is a plain path entry,
which PYTHONPATH precedes); after each mutant the copy's file is restored byte for byte and
checked by hash, in a `finally` (Ctrl-C included). Bytecode is not written (same-size
mutants would otherwise be served from a stale .pyc).

    python bench/mutate.py                 # every target, table + bench/mutate.json
    python bench/mutate.py splits seeds    # only these targets (merged into mutate.json)
    python bench/mutate.py --list          # the mutants, not run
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src" / "ddpflow"
OUT = REPO / "bench" / "mutate.json"
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
          "-o", "addopts=", "--no-header", "-W", "ignore"]
TIMEOUT_S = 240  # per mutant; a mutant that hangs the tests counts as caught (timeout)
CAP = 40  # mutants per function at most (spread evenly over it when there are more)

# name, module (under src/ddpflow), functions, pytest arguments (fast, function-level tests;
# pytest keeps only the last -k, so one -k expression covers all the files)
TARGETS = [
    ("checkpoint", "engine/checkpoint.py", ["latest_valid", "list_checkpoints"],
     ["tests/test_gpu_paths.py", "-k",
      "checkpoint_sidecar or rank_0_chose or no_checkpoint_folder"]),
    ("provenance", "results/provenance.py", ["stale_reason", "stage_result", "expected_record"],
     ["tests/test_claims.py", "-k", "own_record"]),
    ("splits", "data/splits.py", ["hold_out", "train_val", "pool_test", "folder_splits"],
     ["tests/test_data.py", "tests/test_hardening_data.py", "-k",
      "stratified_split or split_folder_names or pool_test"]),
    ("contract", "seams/contract.py", ["check_outputs", "check_item", "check_task"],
     ["tests/test_contract.py", "-m", "not slow", "-k",
      "not cli and not launch and not prepare and not property"]),
    ("export", "inference/export.py", ["_write_format"],
     ["tests/test_claims.py", "-k", "export"]),
    ("leaderboard", "sweeps/leaderboard.py", ["rank"],
     ["tests/test_claims.py", "-k", "leaderboard"]),
    ("seeds", "core/seeds.py", ["seed_sequence"],
     ["tests/test_gpu_paths.py", "tests/test_claims.py", "-k",
      "collide or mixup or seed_sequence"]),
]

FLIP = {ast.Lt: (ast.LtE, ast.GtE), ast.LtE: (ast.Lt, ast.Gt), ast.Gt: (ast.GtE, ast.LtE),
        ast.GtE: (ast.Gt, ast.Lt), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
        ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,), ast.In: (ast.NotIn,),
        ast.NotIn: (ast.In,)}
SYM = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
       ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}


def _functions(tree: ast.Module, names: list[str]):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            yield node


def _in_fstring(func) -> set[int]:
    """ids of nodes inside f-strings (their positions are unreliable before 3.12)."""
    inside = set()
    for node in ast.walk(func):
        if isinstance(node, ast.JoinedStr):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def _docstring(func):
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        return body[0].value
    return None


def mutants(source: str, names: list[str]) -> list[dict]:
    """Every mutant of the named functions: {function, line, what, start, end, text}, the
    source span (character offsets) and the text that replaces it."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(lineno, col):  # ast columns count UTF-8 bytes
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    out = []
    for func in _functions(tree, names):
        skip = _in_fstring(func) | {id(_docstring(func))}
        sites = []  # (node whose source span is replaced, what, replacement text)
        add = sites.append
        for node in ast.walk(func):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Compare):
                for i, op in enumerate(node.ops):
                    for new in FLIP.get(type(op), ()):
                        m = ast.Compare(node.left, list(node.ops), node.comparators)
                        m.ops[i] = new()
                        add((node, f"{SYM[type(op)]} -> {SYM[new]}", f"({ast.unparse(m)})"))
            elif isinstance(node, ast.BoolOp):
                other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
                word = "and -> or" if isinstance(node.op, ast.And) else "or -> and"
                add((node, word, f"({ast.unparse(ast.BoolOp(other, node.values))})"))
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                add((node, "not removed", f"({ast.unparse(node.operand)})"))
            elif isinstance(node, ast.Constant) and type(node.value) is bool:
                add((node, f"{node.value} -> {not node.value}", str(not node.value)))
            elif isinstance(node, ast.Constant) and type(node.value) is int:
                for d in (1, -1):
                    add((node, f"{node.value} -> {node.value + d}", f"({node.value + d})"))
            elif isinstance(node, ast.Name) and node.id in ("min", "max"):
                new = "max" if node.id == "min" else "min"
                add((node, f"{node.id} -> {new}", new))
            elif (isinstance(node, ast.Return) and node.value is not None
                  and not (isinstance(node.value, ast.Constant) and node.value.value is None)):
                add((node.value, "return X -> return None", "None"))
        found = [{"function": func.name, "line": n.lineno, "what": what,
                  "start": offset(n.lineno, n.col_offset),
                  "end": offset(n.end_lineno, n.end_col_offset), "text": text}
                 for n, what, text in sites]
        found.sort(key=lambda m: (m["start"], m["what"]))
        if len(found) > CAP:  # spread the cap evenly over the function
            found = [found[round(i * (len(found) - 1) / (CAP - 1))] for i in range(CAP)]
        out.extend(found)
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_tests(args: list[str], env: dict) -> tuple[str, float]:
    t = time.monotonic()
    try:
        proc = subprocess.run(PYTEST + args, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=TIMEOUT_S,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t
    # 0: all passed; 5: nothing collected (a broken selection, not a survivor)
    if proc.returncode == 5:
        raise SystemExit(f"mutate: the tests {args} select nothing")
    return ("survived" if proc.returncode == 0 else "killed"), time.monotonic() - t


def _without(tests: list[str], words: str) -> list[str]:
    k = tests.index("-k") + 1 if "-k" in tests else None
    if k is None:
        return [*tests, "-k", f"not ({words})"]
    return [*tests[:k], f"({tests[k]}) and not ({words})", *tests[k + 1:]]


def run_target(name, module, functions, tests, scratch: Path, env: dict, list_only: bool):
    path = scratch / "ddpflow" / module
    original = path.read_bytes()
    digest = hashlib.sha256(original).hexdigest()
    source = original.decode()
    found = mutants(source, functions)
    if list_only:
        for m in found:
            print(f"{name:12} {m['function']:16} line {m['line']:4} {m['what']}")
        return {"mutants": len(found)}
    status, secs = run_tests(tests, env)
    if status != "survived":
        raise SystemExit(f"mutate: {name}: the tests fail on the unmutated code ({status})")
    print(f"{name}: {len(found)} mutants, tests take {secs:.0f} s", flush=True)
    results = []
    for m in found:
        text = source[:m["start"]] + m["text"] + source[m["end"]:]
        try:
            ast.parse(text)
        except SyntaxError:
            continue
        try:
            path.write_bytes(text.encode())
            outcome, secs = run_tests(tests, env)
        finally:
            path.write_bytes(original)
            if _digest(path) != digest:
                raise SystemExit(f"mutate: could not restore {path}")
        results.append({k: m[k] for k in ("function", "line", "what")} | {"outcome": outcome})
        print(f"  {outcome:8} {m['function']}:{m['line']} {m['what']} ({secs:.0f} s)",
              flush=True)
    caught = sum(r["outcome"] != "survived" for r in results)
    return {"module": f"src/ddpflow/{module}", "functions": functions,
            "tests": " ".join(tests), "killed": caught, "total": len(results),
            "score": round(caught / len(results), 3) if results else None,
            "survivors": [r for r in results if r["outcome"] == "survived"],
            "mutants": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="*", help="target names (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    ap.add_argument("--json", type=Path, default=OUT, help=f"the results file (default "
                    f"{OUT.relative_to(REPO)}; a run of some targets updates theirs in it)")
    ap.add_argument("--without", metavar="WORDS", help="leave out the tests whose names match "
                    "this -k expression (the score before they were written); mutate.json is "
                    "not written")
    a = ap.parse_args()
    known = {t[0] for t in TARGETS}
    if set(a.targets) - known:
        ap.error(f"unknown target(s) {sorted(set(a.targets) - known)}; known: {sorted(known)}")
    chosen = [t for t in TARGETS if not a.targets or t[0] in a.targets]
    if a.without:
        chosen = [(*t[:3], _without(t[3], a.without)) for t in chosen]
    scratch = Path(tempfile.mkdtemp(prefix="ddpflow-mutate-"))
    try:
        shutil.copytree(PKG, scratch / "ddpflow",
                        ignore=shutil.ignore_patterns("__pycache__"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(scratch), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            PYTHONDONTWRITEBYTECODE="1")
        board = {}
        t0 = time.monotonic()
        for t in chosen:
            board[t[0]] = run_target(*t, scratch, env, a.list)
        if a.list:
            return 0
        print(f"\n{'target':12} {'killed':>6} {'total':>5} {'score':>6}  survivors")
        for name, r in board.items():
            surv = ", ".join(f"{s['function']}:{s['line']} {s['what']}" for s in r["survivors"])
            print(f"{name:12} {r['killed']:6} {r['total']:5} {r['score'] or 0:6.0%}  {surv}")
        print(f"({time.monotonic() - t0:.0f} s)")
        if not a.without:  # merged when written: runs of other targets may have ended since
            old = json.loads(a.json.read_text()) if a.json.is_file() and a.targets else {}
            a.json.write_text(json.dumps(old | board, indent=1) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

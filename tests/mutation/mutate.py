"""Mutation testing of every module that decides a result or a file, and the ratchet CI keeps.

    python tests/mutation/mutate.py run            mutate the functions whose source changed
                                                   since tests/mutation/records.json (make mutate)
    python tests/mutation/mutate.py run --all      every function in scope (hours on 2 cores)
    python tests/mutation/mutate.py run --function engine/checkpoint.py::latest_valid
    python tests/mutation/mutate.py run --module core/checksum.py
    python tests/mutation/mutate.py check          the CI ratchet (make test): see `check`
    python tests/mutation/mutate.py table          mutants / killed / equivalent / survived
                                                   per module, from the records
    python tests/mutation/mutate.py survivors      each survivor with its diff and its tests
    python tests/mutation/mutate.py baseline       shrink the recorded debt (baseline.json) to
                                                   what is still unmutated or surviving

How a run works (why not mutmut or cosmic-ray: our behaviours run in the processes a test
starts, torchrun's ranks, Snakemake's `ddpflow` calls, a Slurm job, and those tools mutate
the test process only (mutmut 3) or rewrite the working tree and rerun everything for each
mutant (cosmic-ray); see tests/mutation/schemata.py):
 1. the checkout is copied to a scratch folder and the modules in SCOPE are replaced by their
    mutation schemata (every mutant compiled in, switched by DDPFLOW_MUTANT);
 2. record: the tests run once on that copy (the mutants off), and every process names the
    sites it reaches for the test it belongs to; a test that fails here is never used;
 3. each mutant runs against the tests that reach its site, fastest first, stopping at the
    first failure, in a process forked from one pytest that collected them once
    (tests/mutation/plugin.py): the first failing test kills it and is recorded as its
    killer; a mutant that outlives BUDGET_S of tests is tried again with all of them;
 4. results go to records.json, per function and keyed by the hash of its syntax tree.
A timeout is not a kill (it is shown as such); a mutant no test reaches is a survivor. A
survivor is killed by a test that asserts the property, or written in equivalent.yaml with
a one-line reason (a mutant that cannot change any behaviour a user could see).

The debt (baseline.json): the functions not yet mutated and the survivors not yet killed
when the ratchet began, each at the hash of its source, and the score's floor. It can only
shrink (`baseline` drops what has since been mutated or killed, never adds) and the floor
only rise; a function in it whose source changes is a changed function like any other.

`check` (the ratchet, run by `make test` in CI) fails when
 - a function's source changed since its record (or its debt entry) and its mutants, run
   now (at most
   CHECK_CHANGED_S seconds of them), leave a survivor that equivalent.yaml does not explain;
   changes too large to mutate in that time must come with their records (run `make mutate`
   before you push);
 - a record holds a survivor that is not explained nor in the debt, or an explanation no
   longer matches;
 - a sample of recorded kills (chosen from the commit, CHECK_SAMPLE_S seconds) no longer dies
   by the test that killed it (a weakened test);
 - the score over the mutated functions is under the debt's floor (MIN_SCORE, the target,
   without a debt).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PKG = REPO / "src" / "ddpflow"
RECORDS = HERE / "records.json"
EQUIVALENT = HERE / "equivalent.yaml"
BASELINE = HERE / "baseline.json"
sys.path.insert(0, str(HERE))
import schemata  # noqa: E402

# the packages whose modules decide a result or a file (module paths under src/ddpflow)
SCOPE = ("engine/", "launch/", "seams/", "data/", "results/", "sweeps/", "inference/",
         "core/", "config/")
# left out, each with its reason
OUT_OF_SCOPE = {
    "core/lazydynamo.py": "start-up speed only: a stub of torch._dynamo's import, no result",
    "results/plots.py": "figures drawn from summary values that are mutated where computed",
}
MIN_SCORE = 0.90
BUDGET_S = 60.0  # seconds of (recorded) test time per mutant in the first pass
FULL_S = 180.0  # the second pass: more of the tests that reach a survivor, up to this much
CHECK_CHANGED_S = 420.0  # the ratchet: seconds of mutant runs for changed functions
CHECK_SAMPLE_S = 150.0  # the ratchet: seconds of recorded kills re-run
JOBS = 2
PYTEST = [sys.executable, "-m", "pytest", "-p", "plugin", "-p", "no:cacheprovider", "-q",
          "--no-header", "-o", "addopts=", "-W", "ignore", "-s"]


def in_scope(module: str) -> bool:
    return module.startswith(SCOPE) and module not in OUT_OF_SCOPE


# ---------------------------------------------------------------- the scratch copy

class Build:
    """The checkout copied with its in-scope modules replaced by their schemata."""

    def __init__(self, modules: list[str] | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="ddpflow-mutate-"))
        shutil.copytree(REPO, self.root / "repo", symlinks=True, ignore=_ignore)
        if (REPO / ".venv").exists():
            (self.root / "repo" / ".venv").symlink_to(REPO / ".venv")
        src = self.root / "repo" / "src"
        shutil.copy(HERE / "switch.py", src / "_ddpflow_mutant.py")
        self.mutants: dict[int, schemata.Mutant] = {}
        self.hashes: dict[str, str] = {}
        self.sources: dict[str, str] = {}
        next_id = 1
        for path in sorted(PKG.rglob("*.py")):
            module = str(path.relative_to(PKG))
            if not in_scope(module) or (modules is not None and module not in modules):
                continue
            source = path.read_text()
            new, found, hashes = schemata.mutate_module(module, source, next_id)
            next_id += len(found)
            (src / "ddpflow" / module).write_text(new)
            self.sources[module] = source
            self.hashes.update(hashes)
            self.mutants.update((m.id, m) for m in found)

    @property
    def repo(self) -> Path:
        return self.root / "repo"

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDPFLOW_MUTANT")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.repo / "src"), str(HERE),
                                                          os.environ.get("PYTHONPATH")]))
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.update(extra)
        return env

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


TOP_IGNORED = {".venv", "results", "logs", ".snakemake", "mlruns", "report.html"}


def _ignore(folder: str, names: list[str]) -> set[str]:
    """What the copy leaves out: the checkout's own runs and caches (its top-level outputs
    only: src/ddpflow/results is code)."""
    top = Path(folder) == REPO
    return {n for n in names if n in ("__pycache__", ".pytest_cache", ".ruff_cache")
            or (top and n in TOP_IGNORED)}


def current_functions() -> tuple[dict[str, str], dict[str, list[schemata.Mutant]]]:
    """{function: hash} and {function: its mutants} of the checkout, without a build."""
    hashes, by_function = {}, collections.defaultdict(list)
    for path in sorted(PKG.rglob("*.py")):
        module = str(path.relative_to(PKG))
        if in_scope(module):
            _src, found, h = schemata.mutate_module(module, path.read_text())
            hashes.update(h)
            for m in found:
                by_function[m.function].append(m)
    return hashes, by_function


# ---------------------------------------------------------------- record and serve

def record(build: Build, tests: list[str], jobs: int, marks: str | None = None
           ) -> tuple[dict, dict, set]:
    """({site: {tests that reach it}}, {test: seconds}, {tests failing unmutated}); `marks`:
    only the tests of that pytest -m expression are recorded (and so used)."""
    folder = build.root / "record"
    folder.mkdir()
    cmd = [*PYTEST, f"--mutate-record={folder}", *(["-m", marks] if marks else []),
           *(["-n", str(jobs), "--dist", "loadfile"]
                                                    if jobs > 1 else []), *tests]
    print(f"mutate: recording which tests reach which site ({len(tests)} test paths)",
          flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=build.repo, env=build.env(DDPFLOW_MUTANT_RECORD=str(folder)),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    print(f"mutate: recorded in {time.monotonic() - t0:.0f} s: {tail[0]}", flush=True)
    hits: dict[int, set] = collections.defaultdict(set)
    for f in folder.glob("*.hits"):
        for line in f.read_text(errors="replace").splitlines():
            test, _, site = line.rpartition("\t")
            if test and site.isdigit():
                hits[int(site)].add(test)
    durations, failed = {}, set()
    for f in folder.glob("durations-*.json"):
        d = json.loads(f.read_text())
        durations.update(d["durations"])
        failed.update(d["failed"])
    return hits, durations, failed


def serve(build: Build, plan: list[dict], jobs: int, label: str,
          budget_s: float | None = None) -> dict[int, dict]:
    """Run each mutant of the plan ({id, tests, timeout}); {id: result}. With budget_s, no
    mutant starts after that many seconds (those left have no result)."""
    if not plan:
        return {}
    folder = Path(tempfile.mkdtemp(dir=build.root, prefix="serve-"))
    out = folder / "results.jsonl"
    deadline = time.time() + budget_s if budget_s is not None else None
    (folder / "plan.json").write_text(json.dumps({"jobs": jobs, "mutants": plan,
                                                  "out": str(out), "deadline": deadline}))
    files = sorted({t.split("::")[0] for m in plan for t in m["tests"]})
    cmd = [*PYTEST, f"--mutate-serve={folder / 'plan.json'}", *files]
    print(f"mutate: {label}: {len(plan)} mutants against {len(files)} test files", flush=True)
    proc = subprocess.Popen(cmd, cwd=build.repo, env=build.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    results: dict[int, dict] = {}
    t0, pos = time.monotonic(), 0
    try:
        while True:
            ended = proc.poll() is not None
            if out.exists():
                with open(out) as f:
                    f.seek(pos)
                    chunk = f.read()
                whole = chunk[:chunk.rfind("\n") + 1]
                pos += len(whole.encode())
                for line in whole.splitlines():
                    r = json.loads(line)
                    results[r["id"]] = r
                    m = build.mutants[r["id"]]
                    print(f"  [{len(results)}/{len(plan)} {time.monotonic() - t0:5.0f} s] "
                          f"{r['outcome']:8} {m.describe()} ({r['seconds']:.0f} s)", flush=True)
            if ended:
                break
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode not in (0, None) and len(results) < len(plan):
        err = proc.stderr.read()[-2000:] if proc.stderr else ""
        raise SystemExit(f"mutate: the test server stopped ({proc.returncode}):\n{err}")
    return results


def choose(mid, hits, durations, failed, budget_s: float) -> tuple[list[str], float]:
    """The tests that reach site `mid`, fastest first, up to budget_s of recorded time (at
    least one); and their time."""
    tests = sorted((t for t in hits.get(mid, ()) if t not in failed and t in durations),
                   key=lambda t: (durations[t], t))
    chosen, spent = [], 0.0
    for t in tests:
        if chosen and spent + durations[t] > budget_s:
            break
        chosen.append(t)
        spent += durations[t]
    return chosen, spent


def make_plan(mutants, hits, durations, failed, budget_s: float, only=None,
              after: float | None = None) -> list[dict]:
    """{id, tests, timeout} per mutant; `after`: only where the budget adds tests to what
    a budget of `after` chose (a second pass)."""
    plan = []
    for m in mutants:
        if only is not None and m.id not in only:
            continue
        chosen, spent = choose(m.id, hits, durations, failed, budget_s)
        if after is not None and len(chosen) <= len(choose(m.id, hits, durations, failed,
                                                           after)[0]):
            continue
        if chosen:
            plan.append({"id": m.id, "tests": chosen, "timeout": 4 * spent + 60})
    return plan


# ---------------------------------------------------------------- records

def load_records() -> dict:
    rec = json.loads(RECORDS.read_text()) if RECORDS.is_file() else {}
    if rec.get("version") != schemata.VERSION:
        return {"version": schemata.VERSION, "functions": {}}
    if "tests" in rec:  # the first format: one shared table of tests
        names, secs = rec.pop("tests"), rec.pop("durations")
        for r in rec["functions"].values():
            own = sorted(set(r["tests"]) | {m[4] for m in r["mutants"] if m[4] >= 0},
                         key=lambda i: (secs[i], names[i]))
            where = {i: k for k, i in enumerate(own)}
            r["tests"] = [[names[i], secs[i]] for i in own]
            for m in r["mutants"]:
                m[4] = where.get(m[4], -1)
    return rec


def save_records(rec: dict) -> None:
    """One function a line (its tests and mutants with it): a change to the records reads
    as a diff of the functions it touched, and two branches' records merge by line."""
    names = sorted(rec["functions"])
    lines = ["{", f' "version": {json.dumps(rec["version"])},', ' "functions": {']
    for i, name in enumerate(names):
        comma = "," if i < len(names) - 1 else ""
        lines.append(f"  {json.dumps(name)}: {json.dumps(rec['functions'][name])}{comma}")
    lines += [" }", "}"]
    RECORDS.write_text("\n".join(lines) + "\n")


def load_baseline() -> dict:
    """The debt: {"unmutated": {function: hash}, "survivors": [[function, hash, ordinal]],
    "floor": score} (empty without baseline.json)."""
    if not BASELINE.is_file():
        return {"unmutated": {}, "survivors": [], "floor": MIN_SCORE}
    return json.loads(BASELINE.read_text())


def changed_functions(rec: dict, hashes: dict, debt: dict) -> list[str]:
    """Functions whose source is neither at its record's hash nor at its debt entry's."""
    return sorted(f for f, h in hashes.items()
                  if rec["functions"].get(f, {}).get("hash") != h
                  and debt["unmutated"].get(f) != h)


def cmd_baseline(a) -> int:
    """Shrink the debt to what is still unmutated or surviving; the floor to the score now
    when higher. Without baseline.json, `--initial` writes the first one."""
    rec, hashes = load_records(), current_functions()[0]
    equiv = equivalent_keys(load_equivalent())
    old = load_baseline()
    unmutated = {f: h for f, h in hashes.items()
                 if rec["functions"].get(f, {}).get("hash") != h}
    survivors = sorted([f, r["hash"], o] for f, r in rec["functions"].items()
                       if hashes.get(f) == r["hash"]
                       for o, _op, _w, outcome, _by in r["mutants"]
                       if outcome != "killed" and (f, r["hash"], o) not in equiv)
    if BASELINE.is_file():
        before = {tuple(s) for s in old["survivors"]}
        unmutated = {f: h for f, h in unmutated.items() if old["unmutated"].get(f) == h}
        survivors = [s for s in survivors if tuple(s) in before]
    elif not a.initial:
        raise SystemExit("mutate: no baseline.json; `baseline --initial` writes the first")
    per = _counts(rec, equiv, None)
    total = collections.Counter()
    for c in per.values():
        total.update(c)
    score = total["killed"] / max(1, total["mutants"] - total["equivalent"])
    floor = max(old["floor"] if BASELINE.is_file() else 0.0, math.floor(score * 1000) / 1000)
    BASELINE.write_text(json.dumps({"floor": floor, "unmutated": unmutated,
                                    "survivors": survivors}, indent=0, sort_keys=True) + "\n")
    print(f"mutate baseline: {len(unmutated)} function(s) unmutated, {len(survivors)} "
          f"survivor(s) owed, floor {floor:.1%}")
    return 0


KEEP_TESTS = 25  # per function: the tests that kill its mutants and the fastest others


def load_equivalent() -> list[dict]:
    if not EQUIVALENT.is_file():
        return []
    return yaml.safe_load(EQUIVALENT.read_text()) or []


def equivalent_keys(entries: list[dict]) -> dict[tuple, dict]:
    return {(e["function"], e["hash"], int(str(e["mutant"]).split(":")[0])): e
            for e in entries}


def mutant_label(m: schemata.Mutant) -> str:
    return f"{m.ordinal}: {m.what}: {m.before[:60]}"


# ---------------------------------------------------------------- run

def cmd_run(a) -> int:
    rec = load_records()
    hashes, by_function = current_functions()
    if a.function or a.module:
        unknown = sorted(set(a.function or ()) - set(hashes))
        unknown += sorted(m for m in a.module or () if not any(
            f.startswith(m + "::") for f in hashes))
        if unknown:
            raise SystemExit(f"mutate: no such function(s) or module(s) in scope: {unknown}")
        wanted = set(a.function or ()) | {f for f in hashes
                                          if f.split("::")[0] in set(a.module or ())}
    elif a.all:
        wanted = set(hashes)
    else:
        wanted = set(changed_functions(rec, hashes, load_baseline()))
    for f in [f for f in rec["functions"] if f not in hashes]:
        del rec["functions"][f]  # gone from the code
    if not wanted:
        print("mutate: every function's record is at its current source; nothing to run")
        save_records(rec)
        return cmd_table(a)
    modules = sorted({f.split("::")[0] for f in wanted})
    build = Build(modules)
    try:
        targets = [m for m in build.mutants.values() if m.function in wanted]
        print(f"mutate: {len(targets)} mutants in {len(wanted)} functions of "
              f"{len(modules)} modules", flush=True)
        tests = a.tests or _tests_for(rec, wanted)
        hits, durations, failed = record(build, tests, a.jobs, a.marks)
        if failed:
            print(f"mutate: {len(failed)} test(s) fail on the unmutated copy and are not used: "
                  f"{sorted(failed)[:5]}", flush=True)
        # a module at a time, its records saved as it ends (a long run can be stopped)
        for module in modules:
            mine = [m for m in targets if m.function.startswith(module + "::")]
            results = serve(build, make_plan(mine, hits, durations, failed, a.budget),
                            a.jobs, f"{module}, first pass")
            again = {i for i, r in results.items() if r["outcome"] != "killed"}
            more = make_plan(mine, hits, durations, failed, FULL_S, again, after=a.budget)
            results.update(serve(build, more, a.jobs, f"{module}, second pass"))
            _store(rec, build, mine, {f for f in wanted if f.startswith(module + "::")},
                   hits, durations, failed, results)
            save_records(rec)
    finally:
        build.close()
    return cmd_table(a)


def _tests_for(rec: dict, wanted: set) -> list[str]:
    """The test files to record: those whose tests reached these functions (or, for a new
    function, other functions of its module) last time, and those that name its module;
    all tests when none is known."""
    files = set()
    for f in wanted:
        module = f.split("::")[0]
        for name, r in rec["functions"].items():
            if name == f or (f not in rec["functions"] and name.startswith(module + "::")):
                files.update(t.split("::")[0] for t, _s in r["tests"])
        stem = Path(module).stem
        dotted = "ddpflow." + module[:-3].replace("/", ".")
        for t in sorted((REPO / "tests").glob("test_*.py")):
            text = t.read_text(errors="replace")
            if dotted in text or f"import {stem}" in text or f" {stem}." in text:
                files.add(str(t.relative_to(REPO)))
    return sorted(files) or ["tests"]


def _store(rec, build, targets, wanted, hits, durations, failed, results):
    by_function = collections.defaultdict(list)
    for m in targets:
        by_function[m.function].append(m)
    for f in wanted:
        reach, killers, rows = set(), set(), []
        for m in sorted(by_function.get(f, []), key=lambda m: m.ordinal):
            r = results.get(m.id)
            covered = [t for t in hits.get(m.id, ()) if t not in failed and t in durations]
            reach.update(covered)
            if r is None:
                outcome, by = ("uncovered" if not covered else "error"), None
            else:
                outcome, by = r["outcome"], r.get("by") if r.get("by") in durations else None
            killers.update([by] if by else [])
            rows.append([m.ordinal, m.op, m.what, outcome, by])
        fastest = sorted(reach - killers, key=lambda t: (durations[t], t))
        tests = sorted(killers | set(fastest[:max(0, KEEP_TESTS - len(killers))]),
                       key=lambda t: (durations[t], t))
        where = {t: k for k, t in enumerate(tests)}
        rec["functions"][f] = {
            "hash": build.hashes[f], "tests": [[t, round(durations[t], 2)] for t in tests],
            "mutants": [[*row[:4], where.get(row[4], -1)] for row in rows]}


# ---------------------------------------------------------------- reports

def _counts(rec, equiv, by_function):
    per = collections.OrderedDict()
    for f in sorted(rec["functions"]):
        r = rec["functions"][f]
        module = f.split("::")[0]
        c = per.setdefault(module, collections.Counter())
        for ordinal, _op, _what, outcome, _by in r["mutants"]:
            c["mutants"] += 1
            if outcome == "killed":
                c["killed"] += 1
            elif (f, r["hash"], ordinal) in equiv:
                c["equivalent"] += 1
            else:
                c["survived"] += 1
                c[outcome] += 1 if outcome != "survived" else 0
    return per


def cmd_table(a=None) -> int:
    rec = load_records()
    equiv = equivalent_keys(load_equivalent())
    per = _counts(rec, equiv, None)
    total = collections.Counter()
    print(f"{'module':32} {'mutants':>7} {'killed':>6} {'equiv':>5} {'survived':>8}  "
          f"(of which timeout / uncovered)")
    for module, c in per.items():
        total.update(c)
        print(f"{module:32} {c['mutants']:7} {c['killed']:6} {c['equivalent']:5} "
              f"{c['survived']:8}  {c['timeout'] or ''} / {c['uncovered'] or ''}")
    score = total["killed"] / max(1, total["mutants"] - total["equivalent"])
    print(f"{'total':32} {total['mutants']:7} {total['killed']:6} {total['equivalent']:5} "
          f"{total['survived']:8}  {total['timeout']} / {total['uncovered']}")
    print(f"score: {score:.1%} killed of the mutants not recorded as equivalent "
          f"(at least {MIN_SCORE:.0%} required)")
    return 0


def cmd_survivors(a) -> int:
    rec = load_records()
    equiv = equivalent_keys(load_equivalent())
    _hashes, by_function = current_functions()
    shown = 0
    for f in sorted(rec["functions"]):
        if a.module and not f.startswith(tuple(a.module)):
            continue
        r = rec["functions"][f]
        muts = {m.ordinal: m for m in by_function.get(f, [])}
        for ordinal, _op, _what, outcome, _by in r["mutants"]:
            if outcome == "killed" or (f, r["hash"], ordinal) in equiv:
                continue
            m = muts.get(ordinal)
            if m is None:
                continue
            shown += 1
            print(_survivor_text(m, outcome, [t for t, _s in r["tests"]]))
            if a.yaml:  # an entry to paste into equivalent.yaml, once the reason is written
                print(f"- function: {f}\n  hash: {r['hash']}\n  mutant: "
                      f"{json.dumps(mutant_label(m))}\n  why: \n")
    print(f"{shown} survivor(s)")
    return 0


def _survivor_text(m: schemata.Mutant, outcome: str, tests: list[str]) -> str:
    ran = ", ".join(tests[:6]) + (f" and {len(tests) - 6} more" if len(tests) > 6 else "")
    before, after = (m.line_before, m.line_after) if m.line_before else (m.before, m.after)
    return (f"{outcome.upper()}: {m.function} line {m.line} ({m.op}: {m.what}) "
            f"[mutant {m.ordinal}]\n  - {before.strip()}\n  + {after.strip()}\n"
            f"  tests that ran: {ran or 'none reach it'}\n")


# ---------------------------------------------------------------- check (CI)

def cmd_check(a) -> int:
    rec = load_records()
    entries = load_equivalent()
    equiv = equivalent_keys(entries)
    hashes, by_function = current_functions()
    problems: list[str] = []
    debt = load_baseline()
    owed = {tuple(s) for s in debt["survivors"]}
    changed = changed_functions(rec, hashes, debt)
    # equivalents must point at a mutant of the function as it is now
    for e in entries:
        f, h = e["function"], e["hash"]
        if hashes.get(f) != h:
            problems.append(f"equivalent.yaml: {f} mutant {e['mutant']!r} was recorded at "
                            f"another version of the function (now {hashes.get(f)}); look at "
                            f"it again")
            continue
        ordinal = int(str(e["mutant"]).split(":")[0])
        m = next((m for m in by_function[f] if m.ordinal == ordinal), None)
        if m is None or not str(e["mutant"]).startswith(f"{ordinal}: {m.what}"):
            problems.append(f"equivalent.yaml: {f} has no mutant {e['mutant']!r} now")
        if not str(e.get("why", "")).strip():
            problems.append(f"equivalent.yaml: {f} mutant {e['mutant']!r} has no reason")
    if changed:
        n = sum(len(by_function[f]) for f in changed)
        print(f"mutate check: {len(changed)} function(s) changed since their records "
              f"({n} mutants): {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}",
              flush=True)
        _check_changed(rec, changed, a, problems)  # their new records replace the old
    for f in sorted(rec["functions"]):
        if f in changed or f not in hashes:
            continue
        r = rec["functions"][f]
        muts = {m.ordinal: m for m in by_function[f]}
        for ordinal, _op, _what, outcome, _by in r["mutants"]:
            if (outcome != "killed" and (f, r["hash"], ordinal) not in equiv
                    and (f, r["hash"], ordinal) not in owed):
                m = muts.get(ordinal)
                problems.append("a survivor no test kills and equivalent.yaml does not "
                                "explain:\n" + (_survivor_text(m, outcome, [
                                    t for t, _s in r["tests"]]) if m else
                                    f"{f} mutant {ordinal}"))
    if not problems:
        _check_sample(rec, hashes, by_function, changed, a, problems)
    per = _counts(rec, equiv, by_function)
    total = collections.Counter()
    for c in per.values():
        total.update(c)
    score = total["killed"] / max(1, total["mutants"] - total["equivalent"])
    floor = debt["floor"]
    print(f"mutate check: score {score:.1%} over {total['mutants']} mutants of "
          f"{len(rec['functions'])} functions ({total['equivalent']} equivalent; the floor "
          f"{floor:.1%}, the target {MIN_SCORE:.0%}); debt: {len(debt['unmutated'])} "
          f"function(s) unmutated, {len(owed)} survivor(s) owed (baseline.json)", flush=True)
    if score < floor:
        # the counts too: a score a few mutants under a floor of 100% still reads 100.0%
        problems.append(f"the mutation score {score:.1%} ({total['killed']} of "
                        f"{total['mutants'] - total['equivalent']} killed) is under its "
                        f"floor {floor:.1%}")
    for p in problems:
        print(f"FAIL mutate check: {p}", flush=True)
    if problems:
        print("Kill each survivor with a test that asserts the property (or explain it in "
              "tests/mutation/equivalent.yaml), then `make mutate` and commit "
              "tests/mutation/records.json.")
        return 1
    print("mutate check: passed", flush=True)
    return 0


def _check_changed(rec, changed, a, problems) -> dict:
    hashes_now, by_function = current_functions()
    n = sum(len(by_function[f]) for f in changed)
    known = [rec["functions"][f] for f in changed if f in rec["functions"]]
    estimate = sum(min(BUDGET_S, sum(secs for _t, secs in r["tests"][:3]) or BUDGET_S)
                   for r in known) / max(1, len(known)) * n / JOBS if known else n * 20.0
    if estimate > a.changed_budget:
        problems.append(
            f"{len(changed)} function(s) changed since tests/mutation/records.json "
            f"({n} mutants, about {estimate:.0f} s to mutate, more than this check's "
            f"{a.changed_budget:.0f} s): run `make mutate` and commit its records:\n    "
            + "\n    ".join(changed[:20]))
        return {}
    modules = sorted({f.split("::")[0] for f in changed})
    build = Build(modules)
    out = {}
    try:
        rec2 = json.loads(json.dumps(rec))
        targets = [m for m in build.mutants.values() if m.function in set(changed)]
        t0 = time.monotonic()
        # the fast tests only: the check's time stays bounded (a slow file would take its
        # whole budget to record); a mutant only a slow test kills needs `make mutate`
        hits, durations, failed = record(build, _tests_for(rec, set(changed)), JOBS,
                                         "not slow")
        plan = make_plan(targets, hits, durations, failed, BUDGET_S)
        left = a.changed_budget - (time.monotonic() - t0)
        results = serve(build, plan, JOBS, "changed functions", budget_s=max(left, 0.0))
        unrun = [p["id"] for p in plan if p["id"] not in results]
        if unrun:
            problems.append(f"{len(unrun)} mutant(s) of the changed functions did not run "
                            f"within this check's {a.changed_budget:.0f} s: run `make mutate` "
                            f"and commit tests/mutation/records.json")
            return {}
        _store(rec2, build, targets, set(changed), hits, durations, failed, results)
        equiv = equivalent_keys(load_equivalent())
        for f in changed:
            r = rec2["functions"][f]
            muts = {m.ordinal: m for m in by_function[f]}
            killed = 0
            for ordinal, _op, _what, outcome, _by in r["mutants"]:
                if outcome == "killed":
                    killed += 1
                elif (f, r["hash"], ordinal) not in equiv:
                    m = muts.get(ordinal)
                    problems.append("a changed function has a survivor:\n" + _survivor_text(
                        m, outcome, [t for t, _s in r["tests"]]))
            out[f] = (killed, len(r["mutants"]))
            rec["functions"][f] = r
    finally:
        build.close()
    return out


def _check_sample(rec, hashes, by_function, changed, a, problems) -> None:
    """Re-run recorded kills (a sample chosen from the commit) with their killing test."""
    pool = []
    for f in sorted(rec["functions"]):
        if f in changed or f not in hashes:
            continue
        for ordinal, _op, _what, outcome, by in rec["functions"][f]["mutants"]:
            if outcome == "killed" and by >= 0:
                pool.append((f, ordinal, *rec["functions"][f]["tests"][by]))
    if not pool or a.sample_budget <= 0:
        return
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip() or "0"
    rng = random.Random(int(hashlib.sha256(head.encode()).hexdigest()[:12], 16))
    rng.shuffle(pool)
    picked, spent = [], 0.0
    for f, ordinal, test, secs in pool:
        d = secs or 5.0
        if spent + d > a.sample_budget * JOBS:
            continue
        picked.append((f, ordinal, test, d))
        spent += d
    modules = sorted({p[0].split("::")[0] for p in picked})
    build = Build(modules)
    try:
        index = {(m.function, m.ordinal): m for m in build.mutants.values()}
        plan = [{"id": index[(f, o)].id, "tests": [test], "timeout": 4 * d + 60}
                for f, o, test, d in picked if (f, o) in index]
        results = serve(build, plan, JOBS, "a sample of recorded kills, re-run",
                        budget_s=a.sample_budget)
        for p in plan:
            r = results.get(p["id"])
            if r is None:  # not started within the budget: a smaller sample, not a failure
                continue
            if r.get("outcome") != "killed":
                m = build.mutants[p["id"]]
                problems.append(f"{p['tests'][0]} killed mutant {m.ordinal} of {m.function} "
                                f"({m.what}: {m.before[:60]!r} -> {m.after[:60]!r}) when it "
                                f"was recorded; now it {r.get('outcome', 'did not run')}")
        print(f"mutate check: {len(plan)} recorded kills re-run", flush=True)
    finally:
        build.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="mutate changed (or --all, or named) functions")
    r.add_argument("--all", action="store_true")
    r.add_argument("--function", action="append", help="module.py::qualname (repeatable)")
    r.add_argument("--module", action="append", help="every function of module.py "
                   "(a path under src/ddpflow, repeatable)")
    r.add_argument("--tests", nargs="*", help="test paths to record (default: the tests that "
                   "reached the functions last time, else all)")
    r.add_argument("--jobs", type=int, default=JOBS)
    r.add_argument("--budget", type=float, default=BUDGET_S)
    r.add_argument("--marks", default=None, help="record only the tests of this pytest -m "
                   "expression ('not slow': minutes, not hours; a mutant only a slow test "
                   "kills then survives)")
    c = sub.add_parser("check", help="the CI ratchet")
    c.add_argument("--changed-budget", type=float, default=CHECK_CHANGED_S)
    c.add_argument("--sample-budget", type=float, default=CHECK_SAMPLE_S)
    sub.add_parser("table", help="the table per module")
    s = sub.add_parser("survivors", help="each survivor with its diff")
    s.add_argument("module", nargs="*", help="module paths (or prefixes) to show")
    s.add_argument("--yaml", action="store_true", help="also an equivalent.yaml entry each")
    b = sub.add_parser("baseline", help="shrink the debt (baseline.json)")
    b.add_argument("--initial", action="store_true", help="write the first baseline.json")
    a = ap.parse_args()
    return {"run": cmd_run, "check": cmd_check, "table": cmd_table,
            "survivors": cmd_survivors, "baseline": cmd_baseline}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())

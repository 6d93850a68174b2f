"""The mutation tool (tests/mutation/): each operator makes the mutant it names, every
mutant is switched in and off by the number it gets, and the ratchet's debt only shrinks."""

from __future__ import annotations

import collections
import json
import sys
import types
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "mutation"
sys.path.insert(0, str(HERE))
import mutate  # noqa: E402
import schemata  # noqa: E402

SOURCE = '''
def pick(xs, limit):
    """Docstrings are never mutated."""
    if not xs:
        raise ValueError(f"no values under {limit}; give some")
    best = max(xs)
    total = sum(xs) + 1
    ok = best < limit and total > 0
    try:
        check(best)
    except KeyError:
        return None
    return best if ok else limit


def check(x):
    return x
'''


def _load(mutated: str, active: int):
    """The mutated module, run with mutant `active` switched on (0: the original)."""
    switch = types.ModuleType("_ddpflow_mutant")
    switch.hit = lambda site: site == active
    sys.modules["_ddpflow_mutant"] = switch
    mod = types.ModuleType("m")
    exec(compile(mutated, "m.py", "exec"), mod.__dict__)
    return mod


def test_every_operator_makes_its_mutant_and_only_the_switched_one_runs():
    mutated, mutants, hashes = schemata.mutate_module("core/x.py", SOURCE)
    ops = {m.op for m in mutants if m.function == "core/x.py::pick"}
    assert {"compare", "boolean", "constant", "arithmetic", "minmax", "return", "statement",
            "handler", "message"} <= ops, ops
    assert set(hashes) == {"core/x.py::pick", "core/x.py::check"}
    assert not any("Docstrings" in m.before for m in mutants)
    original = _load(mutated, 0)
    assert original.pick([1, 2], 5) == 2 and original.pick([9], 5) == 5
    # each mutant alone changes what the function does somewhere, the others stay off
    by_what = {(m.op, m.what): m for m in mutants if m.function == "core/x.py::pick"}
    lt = next(m for (op, what), m in by_what.items() if op == "compare" and "< -> <=" in what)
    assert _load(mutated, lt.id).pick([5], 5) == 5 and original.pick([5], 5) == 5
    assert _load(mutated, lt.id).pick([4], 5) == 4
    swap = next(m for (op, _w), m in by_what.items() if op == "minmax")
    assert _load(mutated, swap.id).pick([1, 2], 5) == 1
    msg = next(m for (op, _w), m in by_what.items() if op == "message")
    with pytest.raises(ValueError) as e:
        _load(mutated, msg.id).pick([], 5)
    assert str(e.value) != "no values under 5; give some"
    handler = next(m for (op, _w), m in by_what.items() if op == "handler")
    mod = _load(mutated, handler.id)
    mod.check = lambda x: {}[x]  # the handled error: the mutant re-raises it
    with pytest.raises(KeyError):
        mod.pick([1], 5)


def test_a_function_hash_follows_its_source_and_not_its_neighbours():
    _s, _m, before = schemata.mutate_module("core/x.py", SOURCE)
    _s, _m, after = schemata.mutate_module("core/x.py", SOURCE.replace("return x",
                                                                       "return x + 1"))
    assert before["core/x.py::pick"] == after["core/x.py::pick"]
    assert before["core/x.py::check"] != after["core/x.py::check"]


@pytest.fixture
def tool(tmp_path, monkeypatch):
    """mutate.py over files in tmp_path, with two functions in scope now."""
    monkeypatch.setattr(mutate, "RECORDS", tmp_path / "records.json")
    monkeypatch.setattr(mutate, "BASELINE", tmp_path / "baseline.json")
    monkeypatch.setattr(mutate, "EQUIVALENT", tmp_path / "equivalent.yaml")
    now = {"core/a.py::f": "h1", "core/a.py::g": "h2", "core/a.py::k": "h3"}
    monkeypatch.setattr(mutate, "current_functions",
                        lambda: (dict(now), collections.defaultdict(list)))
    rec = {"version": schemata.VERSION, "functions": {
        "core/a.py::f": {"hash": "h1", "tests": [["t::x", 0.1]], "mutants": [
            [0, "compare", "< -> <=", "killed", 0], [1, "return", "None", "survived", -1],
            [2, "statement", "removed", "survived", -1]]}}}
    mutate.save_records(rec)
    return now, tmp_path


def test_the_debt_only_shrinks_and_a_changed_function_leaves_it(tool):
    now, tmp = tool
    args = types.SimpleNamespace(initial=False)
    with pytest.raises(SystemExit):
        mutate.cmd_baseline(args)  # no debt yet: only --initial writes the first
    mutate.cmd_baseline(types.SimpleNamespace(initial=True))
    debt = json.loads((tmp / "baseline.json").read_text())
    assert debt["unmutated"] == {"core/a.py::g": "h2", "core/a.py::k": "h3"}
    assert debt["survivors"] == [["core/a.py::f", "h1", 1], ["core/a.py::f", "h1", 2]]
    assert debt["floor"] == pytest.approx(1 / 3, abs=1e-3)
    rec = mutate.load_records()
    assert mutate.changed_functions(rec, now, debt) == []
    # g's source changes: it is a changed function (to be mutated), whatever the debt says
    now["core/a.py::g"] = "h2b"
    assert mutate.changed_functions(rec, now, debt) == ["core/a.py::g"]
    # a survivor killed and k mutated since: the debt drops them and never takes g's new hash
    r = rec["functions"]["core/a.py::f"]
    r["mutants"][1][3] = "killed"
    rec["functions"]["core/a.py::k"] = {"hash": "h3", "tests": [], "mutants": [
        [0, "compare", "== -> !=", "killed", -1]]}
    mutate.save_records(rec)
    mutate.cmd_baseline(args)
    debt = json.loads((tmp / "baseline.json").read_text())
    assert debt["unmutated"] == {} and debt["survivors"] == [["core/a.py::f", "h1", 2]]
    assert debt["floor"] == pytest.approx(3 / 4, abs=1e-3)  # risen with the score
    # a new survivor is never added to the debt
    r["mutants"][0][3] = "survived"
    mutate.save_records(rec)
    mutate.cmd_baseline(args)
    debt = json.loads((tmp / "baseline.json").read_text())
    assert debt["survivors"] == [["core/a.py::f", "h1", 2]]
    assert debt["floor"] == pytest.approx(3 / 4, abs=1e-3)  # and never falls (now 2/4)


def test_the_check_fails_on_a_survivor_the_debt_does_not_owe(tool, capsys):
    now, tmp = tool
    mutate.cmd_baseline(types.SimpleNamespace(initial=True))
    args = types.SimpleNamespace(changed_budget=0.0, sample_budget=0.0)
    assert mutate.cmd_check(args) == 0, capsys.readouterr().out
    rec = mutate.load_records()
    rec["functions"]["core/a.py::f"]["mutants"][0][3] = "survived"  # a test weakened
    mutate.save_records(rec)
    assert mutate.cmd_check(args) == 1
    out = capsys.readouterr().out
    assert "FAIL mutate check: a survivor no test kills" in out
    assert "the mutation score 0.0% (0 of 3 killed) is under its floor 33.3%" in out


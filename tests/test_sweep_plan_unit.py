"""sweeps/plan.py and sweeps/commands.py, piece by piece: a trial's id (its label, the hash of
its overrides, stable when the grid grows), random draws (bounds, four digits, the seed),
the number of trials before anything is expanded, the order of trials, one value or one key
given twice refused with a message naming both places, a swept key checked against the
schema (with the setting it most likely meant), a trial's config placed in the sweep's run
(results, shared data, slots, Slurm's GPUs and cores), the plan file written whole and only
when it changed, read back or refused, and what `ddpflow sweep plan|list` print. Fast: no
training.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.sweeps import commands
from ddpflow.sweeps import plan as P
from ddpflow.sweeps.plan import Trial


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


def _sw(**kw) -> dict:
    sw = {"grid": {}, "variants": [], "random": None, "max_trials": 1000}
    sw.update(kw)
    return sw


def _hash(overrides: dict) -> str:
    blob = json.dumps(sorted(overrides.items()), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:6]


def _cfg(tmp_path: Path, **sweep):
    return from_dict(tiny_config(tmp_path, sweep=sweep))


# ------------------------------------------------------------------ ids

def test_a_values_label_is_short_and_safe_in_a_path():
    assert P._label(0.05) == "0.05"
    assert P._label(True) == "true" and P._label(False) == "false"
    assert P._label([1, 2]) == "1-2"
    assert P._label({"a": 1}) == "a-1"
    assert P._label("a b/c") == "a-b-c"
    assert P._label("--x--") == "x"
    assert P._label("x" * 30) == "x" * 24
    assert P._label("///") == "x" and P._label("") == "x"
    assert P._label(None) == "None"


def test_a_trial_id_is_its_variant_keys_values_and_the_hash_of_its_overrides():
    point = {"stages.0.lr": 0.1, "stages.0.batch_size": 32}
    over = {"model.name": "m", **point}
    assert P.trial_id(point, "big", over) == f"big_lr-0.1_batch_size-32-{_hash(over)}"
    assert P.trial_id(point, None, point) == f"lr-0.1_batch_size-32-{_hash(point)}"
    # the hash sees every override, in any order, the variant's too
    assert P.trial_id(point, "big", dict(reversed(list(over.items())))) == \
        P.trial_id(point, "big", over)
    assert P.trial_id(point, "big", point) != P.trial_id(point, "big", over)
    assert P.trial_id({}, None, {}) == f"base-{_hash({})}"
    assert P.trial_id({}, "v", {"a": 1}) == f"v-{_hash({'a': 1})}"
    # one value, its keys written in another order: one trial
    assert P.trial_id({}, "v", {"model.kwargs": {"b": 1, "a": 2}}) == \
        P.trial_id({}, "v", {"model.kwargs": {"a": 2, "b": 1}})


def test_keys_that_end_alike_are_named_whole_and_a_long_id_is_cut():
    point = {"stages.0.lr": 0.1, "stages.1.lr": 0.2, "seed": 3}
    assert P.trial_id(point, None, point) == \
        f"stages.0.lr-0.1_stages.1.lr-0.2_seed-3-{_hash(point)}"
    long = {f"k{i}": "v" * 20 for i in range(6)}
    tid = P.trial_id(long, None, long)
    readable = "_".join(f"k{i}-{'v' * 20}" for i in range(6))
    assert tid == f"{readable[:80]}-{_hash(long)}"


def test_a_hash_of_values_json_cannot_write_is_their_text():
    over = {"a": Path("/p")}
    blob = json.dumps([["a", "/p"]], sort_keys=True)
    assert P.trial_id({}, None, over).endswith(hashlib.sha256(blob.encode()).hexdigest()[:6])


# ------------------------------------------------------------------ draws

def test_random_draws_follow_the_seed_and_keep_four_digits():
    rng, ref = random.Random(5), random.Random(5)
    assert P._draw(rng, "k", {"uniform": [0.0, 1.0]}) == float(f"{ref.uniform(0.0, 1.0):.4g}")
    x = P._draw(rng, "k", {"log_uniform": [1e-4, 1e-1]})
    assert x == float(f"{math.exp(ref.uniform(math.log(1e-4), math.log(1e-1))):.4g}")
    assert P._draw(rng, "k", {"int_uniform": [2, 9]}) == ref.randint(2, 9)
    assert P._draw(random.Random(0), "k", {"int_uniform": [3.0, 3.0]}) == 3
    assert isinstance(P._draw(random.Random(0), "k", {"int_uniform": [3.0, 3.0]}), int)
    assert P._draw(random.Random(0), "k", {"uniform": [2.5, 2.5]}) == 2.5
    assert P._draw(random.Random(0), "k", {"uniform": [1.0, 1.0001234]}) == 1.0
    ints = {P._draw(rng, "k", {"int_uniform": [0, 2]}) for _ in range(200)}
    assert ints == {0, 1, 2}


def test_a_choice_is_a_copy_of_the_listed_value():
    spec = {"choice": [[1, 2]]}
    got = P._draw(random.Random(0), "k", spec)
    assert got == [1, 2]
    got.append(3)
    assert spec == {"choice": [[1, 2]]}


def test_bad_bounds_are_one_message_naming_the_key():
    assert _refusal(P._draw, random.Random(0), "lr", {"uniform": [2, 1]}) == (
        "invalid sweep: sweep.random.space.lr.uniform: the lower bound 2 is above the upper "
        "bound 1")
    assert _refusal(P._draw, random.Random(0), "lr", {"int_uniform": [5, 4]}).startswith(
        "invalid sweep: sweep.random.space.lr.int_uniform: the lower bound 5")
    for lo in (0, -1):
        assert _refusal(P._draw, random.Random(0), "lr", {"log_uniform": [lo, 1]}) == (
            f"invalid sweep: sweep.random.space.lr.log_uniform bounds must be > 0, got "
            f"[{lo}, 1]; use uniform for ranges that reach 0")


def test_points_of_a_grid_and_of_random_draws():
    grid = _sw(grid={"a": [1, 2], "b": ["x", "y"]})
    assert P._points(grid) == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"},
                               {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    space = {"lr": {"uniform": [0, 1]}, "bs": {"choice": [8, 16, 32]}}
    rand = _sw(random={"samples": 3, "space": space})
    ref = random.Random(0)
    want = [{"lr": float(f"{ref.uniform(0, 1):.4g}"), "bs": ref.choice([8, 16, 32])}
            for _ in range(3)]
    assert P._points(rand) == want
    assert P._points(_sw(random={"samples": 3, "seed": 0, "space": space})) == want
    assert P._points(_sw(random={"samples": 3, "seed": 1, "space": space})) != want
    assert _refusal(P._points, _sw(grid={"a": [1]}, random={"samples": 1, "space": space})) == (
        "invalid sweep: use sweep.grid or sweep.random, not both (variants combine with either)")
    assert P._points(_sw()) == [{}]


def test_the_count_of_trials_without_expanding():
    assert P.count(_sw(grid={"a": [1, 2, 3], "b": [1, 2]})) == 6
    assert P.count(_sw(random={"samples": 7, "space": {}})) == 7
    two = [{"name": "v1"}, {"name": "v2"}]
    assert P.count(_sw(grid={"a": [1, 2, 3]}, variants=two)) == 6
    assert P.count(_sw(variants=two)) == 2
    assert P.count(_sw(variants=[{"name": "v1"}])) == 1


# ------------------------------------------------------------------ expanding

def test_trials_are_each_variant_with_each_point_in_order():
    sw = _sw(grid={"stages.0.lr": [0.1, 0.2]},
             variants=[{"name": "a", "set": {"seed": 1}}, {"name": "b", "set": {"seed": 2}}])
    trials = P.expand({"sweep": sw})
    assert [(t.variant, t.overrides) for t in trials] == [
        ("a", {"seed": 1, "stages.0.lr": 0.1}), ("a", {"seed": 1, "stages.0.lr": 0.2}),
        ("b", {"seed": 2, "stages.0.lr": 0.1}), ("b", {"seed": 2, "stages.0.lr": 0.2})]
    assert trials[0].id == P.trial_id({"stages.0.lr": 0.1}, "a", trials[0].overrides)
    plain = P.expand({"sweep": _sw(grid={"seed": [1, 2]})})
    assert [(t.variant, t.overrides) for t in plain] == [(None, {"seed": 1}), (None, {"seed": 2})]
    bare = P.expand({"sweep": _sw(variants=[{"name": "a"}, {"name": "b", "set": {"seed": 1}}])})
    assert [(t.id.split("-")[0], t.overrides) for t in bare] == [("a", {}), ("b", {"seed": 1})]


def test_adding_a_grid_value_keeps_the_other_ids():
    one = P.expand({"sweep": _sw(grid={"stages.0.lr": [0.1, 0.2]})})
    two = P.expand({"sweep": _sw(grid={"stages.0.lr": [0.1, 0.2, 0.3]})})
    assert [t.id for t in two][:2] == [t.id for t in one]


def test_repeated_variant_names_and_too_many_trials_are_refused():
    vs = [{"name": n, "set": {"seed": i}} for i, n in enumerate(["b", "a", "b", "a", "c"])]
    assert _refusal(P.expand, {"sweep": _sw(variants=vs)}) == (
        "invalid sweep: sweep.variants names must be unique, repeated: a, b")
    sw = _sw(grid={"seed": [1, 2, 3]}, max_trials=2)
    assert _refusal(P.expand, {"sweep": sw}) == (
        "invalid sweep: 3 trials, more than sweep.max_trials 2; shrink the grid or raise "
        "sweep.max_trials")
    assert len(P.expand({"sweep": _sw(grid={"seed": [1, 2, 3]}, max_trials=3)})) == 3


def test_one_meaning_one_text():
    assert P._same(1) == P._same(1.0) == "1"
    assert P._same(True) != P._same(1)
    assert P._same(1.5) == "1.5"
    assert P._same({"b": [2.0, {"c": 3.0}], 1: 0}) == '{"1": 0, "b": [2, {"c": 3}]}'
    assert P._same(Path("p")) == json.dumps(repr(Path("p")))


def test_a_value_listed_twice_is_refused_naming_the_list():
    assert _refusal(P.check_values, _sw(grid={"seed": [1, 2, 1]})) == (
        "invalid sweep: sweep.grid.seed lists the value 1 twice; remove one")
    assert _refusal(P.check_values, _sw(grid={"stages.0.lr": [1, 0.5, 1.0]})) == (
        "invalid sweep: sweep.grid.stages.0.lr lists the value 1 twice (1 and 1.0 mean the "
        "same setting); remove one")
    space = {"lr": {"uniform": [0, 1]}, "bs": {"choice": [8, 16, 8]}}
    assert _refusal(P.check_values, _sw(random={"samples": 1, "space": space})) == (
        "invalid sweep: sweep.random.space.bs.choice lists the value 8 twice; remove one")
    P.check_values(_sw(grid={"a": [True, 1], "b": [0, False]}))
    P.check_values(_sw(random={"samples": 1, "space": {"lr": {"uniform": [0, 1]}}}))
    P.check_values(_sw(random={"samples": 1}))


def test_two_variants_that_set_the_same_values_are_refused():
    vs = [{"name": "a", "set": {"stages.0.lr": 1}}, {"name": "b", "set": {"seed": 1}},
          {"name": "c", "set": {"stages.00.lr": 1.0}}]
    assert _refusal(P.check_values, _sw(variants=vs)) == (
        "invalid sweep: sweep.variants 'a' and 'c' set the same values, so their trials would "
        "be the same runs; remove one")
    assert _refusal(P.check_values, _sw(variants=[{"name": "x"}, {"name": "y", "set": {}}])) \
        .startswith("invalid sweep: sweep.variants 'x' and 'y' set the same values")
    P.check_values(_sw(variants=[{"name": "x", "set": {"seed": 1}},
                                 {"name": "y", "set": {"seed": 2}}]))


def test_a_list_index_has_one_spelling():
    assert P._canonical("stages.01.lr") == "stages.1.lr"
    assert P._canonical("model.kwargs.007x") == "model.kwargs.007x"
    assert P._canonical("a.\u0661") == "a.\u0661"  # an Arabic-Indic one is not an index


def test_a_setting_given_in_two_places_is_refused_naming_both():
    sw = _sw(grid={"stages.0.lr": [0.1]},
             variants=[{"name": "ok", "set": {"seed": 1}},
                       {"name": "v", "set": {"stages.00.lr": 1}}])
    assert _refusal(P.check_places, sw) == (
        "invalid sweep: sweep.grid key 'stages.0.lr' and sweep.variants 'v' set key "
        "'stages.00.lr' set the same setting stages.0.lr; set it in one place (a variant's set "
        "may not repeat a swept key)")
    sw = _sw(grid={"model.kwargs": [{}], "model.kwargs.width": [4]})
    assert _refusal(P.check_places, sw) == (
        "invalid sweep: sweep.grid key 'model.kwargs' and sweep.grid key 'model.kwargs.width' "
        "set the same setting model.kwargs; set it in one place")
    sw = _sw(grid={"model.kwargs.width": [4], "model.kwargs": [{}]})
    assert "set the same setting model.kwargs; set it" in _refusal(P.check_places, sw)
    space = {"stages.0.lr": {"uniform": [0, 1]}}
    sw = _sw(random={"samples": 1, "space": space},
             variants=[{"name": "v", "set": {"stages.0": {}}}])
    assert _refusal(P.check_places, sw).startswith(
        "invalid sweep: sweep.random.space key 'stages.0.lr' and sweep.variants 'v' set key "
        "'stages.0' set the same setting stages.0;")
    # two variants may set one key (each trial has one variant); a key and its neighbour differ
    P.check_places(_sw(grid={"stages.0.lr": [1], "stages.0.lr_x": [1]},
                       variants=[{"name": "a", "set": {"seed": 1}},
                                 {"name": "b", "set": {"seed": 2}}, {"name": "c"}]))
    P.check_places(_sw(random={"samples": 1}))


# ------------------------------------------------------------------ checking keys

def test_a_swept_key_must_name_a_setting():
    P.check_key("stages.0.lr", "sweep.grid key")
    P.check_key("model.kwargs.anything.below", "sweep.grid key")
    assert _refusal(P.check_key, "stages.x.lr", "sweep.grid key") == (
        "invalid sweep: sweep.grid key 'stages.x.lr': 'x' is not a list index")
    assert _refusal(P.check_key, "stages.0.lrr", "sweep.grid key") == (
        "invalid sweep: sweep.grid key 'stages.0.lrr': no setting 'lrr' in stages.0 (did you "
        "mean 'lr'?)")
    assert _refusal(P.check_key, "Seed", "k") == (
        "invalid sweep: k 'Seed': no setting 'Seed' in the config (did you mean 'seed'?)")
    schema = {"type": "object", "properties": {f"p{i:02}": {} for i in range(14)}}
    assert _refusal(P.check_key, "zzzz", "k", schema) == (
        "invalid sweep: k 'zzzz': no setting 'zzzz' in the config (it has: "
        + ", ".join(f"p{i:02}" for i in range(12)) + ")")


def test_keys_every_trial_shares_cannot_be_swept():
    for key, named in [("run", "run"), ("results_dir", "results_dir"), ("sweep.grid", "sweep"),
                       ("hardware.slots", "hardware"), ("hardware.slots.gpus", "hardware"),
                       ("data.prepared_dir", "data"), ("container.image", "container")]:
        assert _refusal(P.check_key, key, "sweep.grid key") == (
            f"invalid sweep: sweep.grid key '{key}': {named} is the same for every trial of a "
            f"sweep and cannot be swept")
    P.check_key("hardware.slotsx", "k", {"type": "object", "properties": {
        "hardware": {"properties": {"slotsx": {}}}}})
    P.check_key("runs", "k", {"type": "object", "properties": {"runs": {}}})


def test_a_list_in_the_schema_takes_an_index():
    schema = {"type": "object", "properties": {
        "a": {"type": "array", "items": {"properties": {"x": {}}}},
        "b": {"items": {"properties": {"y": {}}}}}}
    P.check_key("a.3.x", "k", schema)
    P.check_key("b.0.y", "k", schema)
    assert _refusal(P.check_key, "b.y", "k", schema) == (
        "invalid sweep: k 'b.y': 'y' is not a list index")
    assert _refusal(P.check_key, "a.1.z", "k", schema).startswith(
        "invalid sweep: k 'a.1.z': no setting 'z' in a.1 (")


def test_the_setting_a_misspelt_key_meant():
    names = ["lr", "batch_size", "epochs", "lr_schedule", "x"]
    assert P._closest("LR", names) == "lr"
    assert P._closest("batch", names) == "batch_size"
    assert P._closest("lr_sched", names) == "lr_schedule"
    assert P._closest("lrs", names) == "lr"
    assert P._closest("epoch", names) == "epochs"
    assert P._closest("xqqqqq", names) is None  # a one-letter name is no stem
    assert P._closest("e", ["epochs", "ex"]) == "ex"  # nor is a one-letter key
    assert P._closest("ep", ["epochs", "x"]) == "epochs"  # a two-letter key is
    assert P._closest("epohcs", names) == "epochs"
    assert P._closest("qqqq", names) is None


# ------------------------------------------------------------------ a trial's config

def test_a_trials_config_is_the_base_with_its_overrides_and_no_sweep(tmp_path):
    d = from_dict(tiny_config(tmp_path, sweep={"grid": {"stages.0.lr": [0.1]}})).to_dict()
    value = {"w": [1]}
    t = P.trial_dict(d, Trial("t1", {"stages.0.lr": 0.3, "model.kwargs": value}, None))
    assert "sweep" not in t and "sweep" in d
    assert t["stages"][0]["lr"] == 0.3 and d["stages"][0]["lr"] == 0.05
    value["w"].append(2)
    assert t["model"]["kwargs"] == {"w": [1]}
    assert _refusal(P.trial_dict, d, Trial("t2", {"stages.5.lr": 1}, None)).startswith(
        "sweep trial t2: stages.5.lr: '5' is not an index of stages")


def test_a_trial_lives_in_the_sweeps_run_and_shares_its_data_and_slots(tmp_path):
    from ddpflow.data.prepare import settings_fingerprint

    cfg = _cfg(tmp_path, grid={"seed": [1]}, gpus_per_trial=2, threads_per_trial=3)
    trial = Trial("tid", {"seed": 1}, None)
    t = P._place(cfg, P.trial_dict(cfg.to_dict(), trial), trial)
    run = cfg.run_dir
    assert t["results_dir"] == str(run / "trials") and t["run"] == "tid"
    assert t["hardware"]["slots"] == {"pool": str(run / "sweep" / "slots"), "gpus": 2,
                                      "threads": 3}
    t2 = dict(t, data=dict(t["data"], prepared_dir=None))
    assert t["data"]["prepared_dir"] == str(run / "sweep" / "data"
                                            / settings_fingerprint(from_dict(t2)))
    assert t["hardware"]["threads_per_rank"] == 1  # set in the config: kept
    assert t["slurm"]["gpus"] == 2 and t["slurm"]["gres"] is None
    assert t["slurm"]["cpus"] == 4


def test_slurm_asks_each_trial_its_own_gpus_or_cores(tmp_path):
    base = tiny_config(tmp_path, sweep={"grid": {"seed": [1]}, "gpus_per_trial": 2,
                                        "threads_per_trial": 6},
                       slurm={"gpus": 4, "gres": "gpu:a100:4"})
    cfg = from_dict(base)
    trial = Trial("tid", {}, None)
    t = P._place(cfg, P.trial_dict(cfg.to_dict(), trial), trial)
    assert (t["slurm"]["gpus"], t["slurm"]["gres"]) == (2, "gpu:a100:2")
    cpu = tiny_config(tmp_path, sweep={"grid": {"seed": [1]}, "threads_per_trial": 6},
                      slurm={"gpus": 0, "cpus": 4},
                      hardware={"device": "cpu", "threads_per_rank": "auto"})
    cfg = from_dict(cpu)
    t = P._place(cfg, P.trial_dict(cfg.to_dict(), trial), trial)
    assert (t["slurm"]["gpus"], t["slurm"]["cpus"]) == (0, 6)
    assert t["hardware"]["threads_per_rank"] == 6
    cpu["slurm"]["cpus"] = 8
    cpu["hardware"]["device"] = "auto"
    cfg = from_dict(cpu)
    t = P._place(cfg, P.trial_dict(cfg.to_dict(), trial), trial)
    assert t["slurm"]["cpus"] == 8 and t["hardware"]["threads_per_rank"] == "auto"


def test_plan_checks_every_trial_and_names_the_bad_one(tmp_path):
    assert _refusal(P.plan, from_dict(tiny_config(tmp_path))) == (
        "this config has no sweep: set sweep.grid, sweep.variants or sweep.random (see "
        "docs/SWEEPS.md)")
    cfg = _cfg(tmp_path, grid={"stages.0.lr": [0.1, -1.0]})
    bad = P.expand(cfg.to_dict())[1]
    msg = _refusal(P.plan, cfg)
    assert msg.startswith(f"sweep trial {bad.id} (stages.0.lr=-1.0): ") and "lr" in msg[40:]
    assert _refusal(P.plan, _cfg(tmp_path, grid={"stages.0.lrr": [1]})).startswith(
        "invalid sweep: sweep.grid key 'stages.0.lrr': no setting 'lrr'")
    space = {"stages.0.lrr": {"uniform": [0, 1]}}
    assert _refusal(P.plan, _cfg(tmp_path, random={"samples": 1, "space": space})).startswith(
        "invalid sweep: sweep.random.space key 'stages.0.lrr'")
    vs = [{"name": "v", "set": {"sed": 1}}]
    assert _refusal(P.plan, _cfg(tmp_path, variants=vs)) == (
        "invalid sweep: sweep.variants 'v' key 'sed': no setting 'sed' in the config (did you "
        "mean 'seed'?)")


def test_a_trials_model_is_checked_as_launch_checks_it(tmp_path):
    cfg = _cfg(tmp_path, grid={"model.kwargs.widht": [8]})
    trial = P.expand(cfg.to_dict())[0]
    assert _refusal(P.plan, cfg).startswith(
        f"sweep trial {trial.id} (model.kwargs.widht=8): model.kwargs.widht: smallcnn takes no "
        f"argument widht (did you mean 'width'?)")


def test_plan_gives_each_trial_its_config(tmp_path):
    cfg = _cfg(tmp_path, grid={"stages.0.lr": [0.1, 0.2]})
    out = P.plan(cfg)
    assert [(t.overrides, d["stages"][0]["lr"], d["run"]) for t, d in out] == [
        ({"stages.0.lr": 0.1}, 0.1, out[0][0].id), ({"stages.0.lr": 0.2}, 0.2, out[1][0].id)]
    assert out[0][1]["data"]["prepared_dir"] == out[1][1]["data"]["prepared_dir"]


def test_a_trial_too_big_for_this_machine_stops_the_plan_unless_slurm_places_it(
        tmp_path, monkeypatch):
    from ddpflow.launch.slots import usable_cores

    n = len(usable_cores())
    cfg = from_dict(tiny_config(tmp_path, sweep={"grid": {"seed": [1]},
                                                 "threads_per_trial": n + 1},
                                hardware={"device": "cpu"}))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert _refusal(P.plan, cfg) == (
        f"sweep.threads_per_trial is {n + 1} but this machine has {n} usable CPU core(s); use "
        f"at most {n}")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    assert len(P.plan(cfg)) == 1


def test_a_trials_overrides_shown_as_json():
    assert P._shown(Trial("t", {"a": 1, "b": "x", "c": [1, 2]}, None)) == 'a=1, b="x", c=[1, 2]'


# ------------------------------------------------------------------ the plan file

def test_the_plan_and_trial_configs_are_written_whole_and_only_when_changed(tmp_path):
    from ddpflow.config.rerun import hashes

    cfg = _cfg(tmp_path, grid={"stages.0.lr": [0.1, 0.2]},
               variants=[{"name": "v", "set": {"seed": 3}}])
    trials = P.plan(cfg)
    path = P.write_plan(cfg, trials)
    assert path == cfg.run_dir / "sweep" / "plan.json"
    blob = json.loads(path.read_text())
    first, t = trials[0]
    tc = cfg.run_dir / "trials" / first.id / "trial_config.json"
    assert blob == {"run": "t", "search": "none", "swept": ["seed", "stages.0.lr"], "trials": [
        {"id": tr.id, "variant": "v", "overrides": tr.overrides,
         "config": str(cfg.run_dir / "trials" / tr.id / "trial_config.json"),
         "prepared_dir": d["data"]["prepared_dir"], "stages": ["s1"], "hashes": hashes(d)}
        for tr, d in trials]}
    assert tc.read_text() == json.dumps(t, indent=2, sort_keys=True)
    assert P.read_plan(cfg) == blob
    stamps = (path.stat().st_ino, path.stat().st_mtime_ns, tc.stat().st_ino)
    P.write_plan(cfg, trials)
    assert (path.stat().st_ino, path.stat().st_mtime_ns, tc.stat().st_ino) == stamps
    tc.write_text("{}")
    path.write_text("{}")
    P.write_plan(cfg, trials)
    assert tc.read_text() == json.dumps(t, indent=2, sort_keys=True)
    assert json.loads(path.read_text()) == blob


def test_a_trial_config_is_rewritten_when_it_changed(tmp_path):
    cfg = _cfg(tmp_path, grid={"seed": [1]})
    trial = Trial("tid", {}, None)
    path = P.write_trial_config(cfg, trial, {"a": 1})
    assert path == cfg.run_dir / "trials" / "tid" / "trial_config.json"
    ino = path.stat().st_ino
    assert P.write_trial_config(cfg, trial, {"a": 1}).stat().st_ino == ino
    P.write_trial_config(cfg, trial, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}


def test_a_tpe_plan_names_the_space_it_draws_from(tmp_path):
    pytest.importorskip("optuna")
    space = {"stages.0.lr": {"log_uniform": [0.01, 0.1]}, "seed": {"choice": [1, 2]}}
    cfg = _cfg(tmp_path, search="tpe", random={"samples": 4, "space": space})
    assert P.plan(cfg) == []
    path = P.write_plan(cfg, [])
    assert json.loads(path.read_text()) == {"run": "t", "trials": [], "search": "tpe",
                                            "swept": ["seed", "stages.0.lr"]}


def test_a_missing_or_damaged_plan_says_how_to_remake_it(tmp_path):
    cfg = _cfg(tmp_path, grid={"seed": [1]})
    path = cfg.run_dir / "sweep" / "plan.json"
    assert _refusal(P.read_plan, cfg) == (
        f"no sweep plan at {path}; run `ddpflow sweep plan --config ...` (the workflow does "
        f"this when it starts)")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"trials": [{"id": "../x", "overrides": {}}], "swept": []}))
    msg = _refusal(P.read_plan, cfg)
    assert str(path) in msg and msg.endswith(P.PLAN_FIX)
    path.write_text(json.dumps({"trials": [{"id": "a_b.c-1", "overrides": {}}], "swept": []}))
    assert P.read_plan(cfg)["trials"][0]["id"] == "a_b.c-1"


def test_a_trials_config_path_stays_in_the_trials_folder(tmp_path):
    cfg = _cfg(tmp_path, grid={"seed": [1]})
    assert P.trial_config_path(cfg, {"id": "a", "config": "/elsewhere/c.json"}) == \
        cfg.run_dir / "trials" / "a" / "trial_config.json"
    assert _refusal(P.trial_config_path, cfg, {"id": "../a"}).startswith(
        f"{cfg.run_dir / 'sweep' / 'plan.json'}: trials.id: '../a' goes up with '..', outside "
        f"{cfg.run_dir / 'trials'}")


# ------------------------------------------------------------------ the command

def test_sweep_list_prints_each_trial_and_plan_writes_the_plan(tmp_path, capsys):
    cfg = _cfg(tmp_path, grid={"stages.0.lr": [0.1, 0.2]})
    assert commands.command(cfg, SimpleNamespace(action="list")) == 0
    ids = [t.id for t in P.expand(cfg.to_dict())]
    assert capsys.readouterr().out == (f"{ids[0]}\tstages.0.lr=0.1\n{ids[1]}\tstages.0.lr=0.2\n")
    assert not (cfg.run_dir / "sweep").exists()
    assert commands.command(cfg, SimpleNamespace(action="plan")) == 0
    err = capsys.readouterr().err
    assert err == (f"ddpflow: sweep of 2 trial(s), 1 prepared dataset(s): "
                   f"{cfg.run_dir / 'sweep' / 'plan.json'}\n")
    assert [t["id"] for t in P.read_plan(cfg)["trials"]] == ids
    cfg = _cfg(tmp_path, grid={"data.train_size": [512, 256]})
    commands.command(cfg, SimpleNamespace(action="plan"))
    assert "sweep of 2 trial(s), 2 prepared dataset(s)" in capsys.readouterr().err


def test_sweep_collect_prints_the_headline_it_wrote(tmp_path, capsys):
    cfg = _cfg(tmp_path, grid={"stages.0.lr": [0.1, 0.2]})
    commands.command(cfg, SimpleNamespace(action="plan"))
    capsys.readouterr()
    assert commands.command(cfg, SimpleNamespace(action="collect", logs=None)) == 0
    out = capsys.readouterr().out
    assert out == (cfg.run_dir / "sweep" / "headline.txt").read_text()
    assert out.startswith("ddpflow sweep 't': 0/2 trial(s) finished")


def test_sweep_list_of_a_tpe_sweep_says_its_trials_come_later(tmp_path, capsys):
    pytest.importorskip("optuna")
    space = {"stages.0.lr": {"log_uniform": [0.01, 0.1]}, "seed": {"choice": [1, 2]}}
    cfg = _cfg(tmp_path, search="tpe", random={"samples": 4, "space": space})
    assert commands.command(cfg, SimpleNamespace(action="list")) == 0
    assert capsys.readouterr().out == (
        "# sweep.search tpe: up to 4 trial(s) drawn while the sweep runs (ddpflow sweep "
        "schedule), from stages.0.lr, seed\n")


# ------------------------------------------------------------------ the leaderboard

TWO_STAGES = [{"name": "a", "epochs": 1, "batch_size": 32, "lr": 0.05},
              {"name": "b", "epochs": 1, "batch_size": 32, "lr": 0.05}]


def _sweep(tmp_path: Path, grid: dict, **top):
    """A planned sweep on CPU: (its config, {trial id: the trial's config})."""
    cfg = from_dict(tiny_config(tmp_path, sweep={"grid": grid}, hardware={"device": "cpu"},
                                **top))
    P.write_plan(cfg, P.plan(cfg))
    trials = {e["id"]: from_dict(json.loads(P.trial_config_path(cfg, e).read_text()))
              for e in P.read_plan(cfg)["trials"]}
    return cfg, trials


def _finish(tcfg, stage: str, gpus: list | None = None, **summary) -> None:
    """A stage's files as its last step writes them: final.pt, its summary (with the record
    of what it was made from) and, from the slot it ran in, slot.json."""
    from ddpflow.core.checksum import sha256_of
    from ddpflow.results.provenance import expected_record

    folder = tcfg.stage_dir(stage)
    folder.mkdir(parents=True, exist_ok=True)
    record = expected_record(tcfg, stage)
    (folder / "final.pt").write_bytes(stage.encode() + tcfg.run.encode())
    s = {"finished": True, "steps": 10, "wall_time_s": 1.0, "world_size": 1,
         "monitor": "val_acc", "monitor_mode": "max", "record": record,
         "final_sha256": sha256_of(folder / "final.pt"), **summary}
    (folder / "summary.json").write_text(json.dumps(s))
    if gpus is not None:
        (folder / "slot.json").write_text(json.dumps({"slot": 0, "gpus": gpus}))


def _ids(trials: dict, **by_lr) -> dict:
    """{name: trial id} for the trial of each stages.1.lr."""
    return {name: next(i for i, t in trials.items() if t.stages[1].lr == lr)
            for name, lr in by_lr.items()}


def test_the_reason_a_trial_failed_is_its_logs_last_error(tmp_path):
    from ddpflow.sweeps.leaderboard import reason_from_log

    log = tmp_path / "train.log"
    assert reason_from_log(log) is None
    log.write_text("")
    assert reason_from_log(log) is None
    log.write_text("starting\nddpflow: error: batch too big\nTraceback\n  boom  \n\n")
    assert reason_from_log(log) == "ddpflow: error: batch too big"
    log.write_text("starting\n  ValueError: bad\n\n   \n")
    assert reason_from_log(log) == "ValueError: bad"
    log.write_bytes(b"x\nerror: " + b"\xff" + b"y" * 400 + b"\n")
    assert reason_from_log(log) == ("error: \ufffd" + "y" * 400)[:300]
    assert reason_from_log(tmp_path) is None  # a folder: no reason, not a traceback


def test_a_trials_row_adds_up_its_stages_and_takes_the_last_ones_numbers(tmp_path):
    from ddpflow.sweeps.leaderboard import trial_row

    cfg, trials = _sweep(tmp_path, {"stages.1.lr": [0.1, 0.2]}, stages=TWO_STAGES)
    tid, tcfg = next(iter(trials.items()))
    entry = next(e for e in P.read_plan(cfg)["trials"] if e["id"] == tid)
    _finish(tcfg, "a", gpus=["0", "1"], wall_time_s=1000.004, steps=7, monitor_mode="min",
            best_value=0.1, test_metrics={"test_top_5": 0.05})
    stage_b = tcfg.stage_dir("b")
    _finish(tcfg, "b", gpus=["0"], wall_time_s=3000.04, steps=5, best_value=0.8,
            monitor="val_top_5", final_metrics={"val_top_5": 0.7},
            test_metrics={"test_top_5": 0.75, "test_5": 0.1},
            mean_samples_per_s=3.0, wall_samples_per_s=12.5)
    (stage_b / "best.pt").write_bytes(b"best")
    row = trial_row(cfg, entry, tmp_path / "logs")
    assert row == {
        "trial": tid, "variant": None, "overrides": {"stages.1.lr": tcfg.stages[1].lr},
        "param:stages.1.lr": tcfg.stages[1].lr, "wall_time_s": 4000.04,
        "slots": [{"stage": "a", "slot": 0, "gpus": ["0", "1"]},
                  {"stage": "b", "slot": 0, "gpus": ["0"]}],
        "gpu_hours": 2.2222, "monitor": "val_top_5", "mode": "max",
        "steps": 12, "wall_samples_per_s": 12.5, "final_value": 0.7, "best_value": 0.8,
        "test_value": 0.75, "weights": str(stage_b / "best.pt"),
        "report": str(tcfg.run_dir / "summary" / "report.html"),
        "config": str(P.trial_config_path(cfg, entry)), "status": "finished", "reason": ""}
    (stage_b / "best.pt").unlink()
    (tcfg.stage_dir("a") / "slot.json").unlink()
    (stage_b / "slot.json").write_text(json.dumps({"slot": 1, "gpus": None}))
    row = trial_row(cfg, entry, tmp_path / "logs")
    assert row["weights"] == str(stage_b / "final.pt")
    assert (row["gpu_hours"], row["slots"]) == (0.0, [{"stage": "b", "slot": 1, "gpus": None}])
    (stage_b / "slot.json").unlink()  # no slot record: no GPU-hours known
    row = trial_row(cfg, entry, tmp_path / "logs")
    assert (row["gpu_hours"], row["slots"], row["wall_time_s"]) == (0.0, [], 4000.04)


def test_a_row_without_a_monitor_or_finished_stage_has_no_numbers(tmp_path):
    from ddpflow.sweeps.leaderboard import trial_row

    cfg, trials = _sweep(tmp_path, {"stages.1.lr": [0.1]}, stages=TWO_STAGES)
    tid, tcfg = next(iter(trials.items()))
    entry = P.read_plan(cfg)["trials"][0]
    row = trial_row(cfg, entry, tmp_path / "logs")
    assert (row["wall_time_s"], row["gpu_hours"], row["steps"], row["monitor"], row["mode"],
            row["final_value"], row["best_value"], row["test_value"], row["weights"]) == (
        None, 0.0, 0, None, None, None, None, None, None)
    assert (row["status"], row["reason"]) == (
        "not finished", "stage a: not started: no stage folder")
    _finish(tcfg, "a", gpus=["0"], wall_time_s=4.0)
    _finish(tcfg, "b", monitor=None, monitor_mode=None, best_value=0.5,
            final_metrics={"None": 1.0})
    row = trial_row(cfg, entry, tmp_path / "logs")
    assert (row["monitor"], row["final_value"], row["test_value"], row["best_value"]) == (
        None, None, None, 0.5)
    assert row["wall_time_s"] == 5.0 and row["gpu_hours"] == round(5.0 / 3600, 4)


def test_a_damaged_trial_config_is_one_message_naming_the_trial(tmp_path):
    from ddpflow.sweeps.leaderboard import trial_row

    cfg, trials = _sweep(tmp_path, {"stages.1.lr": [0.1]}, stages=TWO_STAGES)
    entry = P.read_plan(cfg)["trials"][0]
    path = P.trial_config_path(cfg, entry)
    path.write_text("[]")
    assert _refusal(trial_row, cfg, entry, tmp_path) == (
        f"{path} (trial {entry['id']}'s config): (top level): [] is not of type 'object'; "
        f"{P.PLAN_FIX}")


def test_a_trials_status_names_its_first_bad_stage(tmp_path):
    from ddpflow.sweeps.leaderboard import trial_row

    cfg, trials = _sweep(tmp_path, {"stages.1.lr": [0.1]}, stages=TWO_STAGES)
    tid, tcfg = next(iter(trials.items()))
    entry = P.read_plan(cfg)["trials"][0]
    logs = tmp_path / "logs"

    def status():
        row = trial_row(cfg, entry, logs)
        return row["status"], row["reason"]

    _finish(tcfg, "a")
    tcfg.stage_dir("b").mkdir(parents=True)
    assert status() == ("not finished", "stage b: not finished: no summary.json")
    (logs / tid).mkdir(parents=True)
    (logs / tid / "train_b.log").write_text("ddpflow: error: out of memory\n")
    (logs / tid / "train_a.log").write_text("ddpflow: error: not this one\n")
    assert status() == ("failed", "stage b: ddpflow: error: out of memory")
    (tcfg.stage_dir("b") / "failed.json").write_text(json.dumps({"reason": "loss is NaN"}))
    assert status() == ("diverged", "stage b: loss is NaN")
    (tcfg.stage_dir("a") / "final.pt").write_bytes(b"replaced")
    assert status() == ("stale", "stage a: stale: final.pt was replaced after the stage "
                                 "finished")
    (tcfg.stage_dir("a") / "summary.json").write_text("{")
    assert status() == ("failed", "stage a: ddpflow: error: not this one")  # a run again


def test_a_stage_with_no_reason_anywhere_is_not_run(tmp_path):
    from ddpflow.sweeps.leaderboard import _status

    cfg = from_dict(tiny_config(tmp_path))
    rows = [{"finished": False, "note": ""}]
    assert _status(cfg, rows, tmp_path) == ("not finished", "stage s1: not run")
    assert _status(cfg, [{"finished": True}], tmp_path) == ("finished", "")


def _r(trial, status="finished", value=None, mode="max", **kw):
    return {"trial": trial, "status": status, "best_value": value, "mode": mode, **kw}


def test_finished_trials_rank_first_by_their_value():
    from ddpflow.sweeps.leaderboard import rank

    rows = rank([_r("d", "failed", 0.99), _r("c", value=0.5), _r("a", value=0.9),
                 _r("b", value=0.9), _r("e", value=float("nan")), _r("f", value=None),
                 _r("g", value="0.95")])
    assert [(r["trial"], r["rank"], r["best"]) for r in rows] == [
        ("a", 1, True), ("b", 2, False), ("c", 3, False), ("d", 4, False), ("e", 5, False),
        ("f", 6, False), ("g", 7, False)]
    rows = rank([_r("a", value=0.9, mode="min"), _r("b", value=0.1, mode="min"),
                 _r("c", value=-1, mode=None)])
    assert [r["trial"] for r in rows] == ["c", "b", "a"]
    rows = rank([_r("a", "failed", 0.1), _r("b", "stale", 0.2)])
    assert [(r["trial"], r["best"]) for r in rows] == [("a", False), ("b", False)]
    assert rank([_r("a", value=float("inf"))])[0]["best"] is False


@pytest.fixture
def drawn(monkeypatch):
    """What each saved figure shows (its axes' scale, labels, points and colours), noted as
    it is saved; the PNG is still written."""
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    seen: dict[str, dict] = {}
    real = Figure.savefig

    def savefig(fig, path, *a, **kw):
        ax = fig.axes[0]
        box = ax.get_tightbbox(fig.canvas.get_renderer())
        margins = (box.x0, box.y0, fig.bbox.width - box.x1, fig.bbox.height - box.y1)
        # laid out tight: nothing cut off, no margin wider than tight_layout's pad (~15 px)
        seen[Path(path).name + ":fits"] = all(0 <= m <= 20 for m in margins)
        seen[Path(path).name] = {
            "xscale": ax.get_xscale(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "title": ax.get_title(), "dpi": kw.get("dpi"),
            "size": tuple(fig.get_size_inches()),
            "xticks": [t.get_text() for t in ax.get_xticklabels()],
            "tickstyle": [(t.get_rotation(), t.get_fontsize()) for t in ax.get_xticklabels()],
            "points": [[list(map(float, p)) for p in c.get_offsets()] for c in ax.collections],
            "colours": [[to_hex(f) for f in c.get_facecolors()] for c in ax.collections],
            "marks": [(list(map(float, c.get_sizes())), c.get_zorder()) for c in ax.collections],
            "lines": [(list(map(float, ln.get_xdata())), [None if y is None else float(y)
                                                          for y in ln.get_ydata()],
                       to_hex(ln.get_color()), ln.get_linewidth(), ln.get_linestyle())
                      for ln in ax.get_lines()],
            "xlocs": [float(x) for x in ax.get_xticks()],
            "legend": [(t.get_text(), t.get_fontsize()) for t in ax.get_legend().get_texts()]
            if ax.get_legend() else None}
        return real(fig, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


def _board(tmp_path, **top):
    """A sweep of three trials: lr 0.01 (finished, 0.6), 0.1 (finished, 0.9, the best),
    1.0 (failed, its log names why)."""
    cfg, trials = _sweep(tmp_path, {"stages.1.lr": [0.01, 0.1, 1.0]}, stages=TWO_STAGES,
                         **top)
    ids = _ids(trials, low=0.01, best=0.1, bad=1.0)
    for name, value, wall in (("low", 0.6, 3.0), ("best", 0.9, 40.0)):
        t = trials[ids[name]]
        _finish(t, "a", gpus=["0"], wall_time_s=1.0)
        _finish(t, "b", gpus=["0"], wall_time_s=wall - 1, best_value=value,
                final_metrics={"val_acc": value - 0.05})
        t.run_dir.joinpath("summary").mkdir()
        t.run_dir.joinpath("summary", "report.html").write_text("<html></html>")
    logs = cfg.run_dir / "logs" / "trials" / ids["bad"]
    logs.mkdir(parents=True)
    (logs / "train_a.log").write_text("ddpflow: error: <bad> & worse\n")
    return cfg, trials, ids


def test_collect_writes_the_whole_leaderboard_best_trial_first(tmp_path, drawn):
    from ddpflow.sweeps.leaderboard import COLUMNS, collect

    cfg, trials, ids = _board(tmp_path)
    out = cfg.run_dir / "sweep"
    (out / "metric_vs_gone.png").write_bytes(b"old")
    (out / "keep.txt").write_text("mine")
    text = collect(cfg)
    board = json.loads((out / "leaderboard.json").read_text())
    assert [(r["trial"], r["rank"], r["best"], r["status"]) for r in board["trials"]] == [
        (ids["best"], 1, True, "finished"), (ids["low"], 2, False, "finished"),
        (ids["bad"], 3, False, "failed")]
    best = board["trials"][0]
    assert board["best"] == {"trial": ids["best"], "value": 0.9, "monitor": "val_acc",
                             "weights": best["weights"]}
    assert best["weights"] == str(trials[ids["best"]].stage_dir("b") / "final.pt")
    assert (board["run"], board["swept"], board["schedule"]) == ("t", ["stages.1.lr"], None)
    assert board["figures"] == ["metric_vs_stages_1_lr.png", "metric_vs_wall_time.png"]
    assert sorted(p.name for p in out.iterdir()) == [
        "headline.txt", "keep.txt", "leaderboard.csv", "leaderboard.json",
        "metric_vs_stages_1_lr.png", "metric_vs_wall_time.png", "plan.json", "report.html"]
    assert (out / "headline.txt").read_text() == text
    bundle = out / f"best-{ids['best']}"
    config = P.trial_config_path(cfg, {"id": ids["best"]})
    assert text == (
        f"ddpflow sweep 't': 2/3 trial(s) finished: {out / 'report.html'}\n"
        f"  best {ids['best']}: val_acc 0.9000 -> {best['weights']}\n"
        f"  export it: ddpflow export --config {config} --weights best --out {bundle}\n"
        f"  then:      ddpflow predict --bundle {bundle} IMAGE_OR_FOLDER...\n"
        f"  {ids['bad']}: failed (stage a: ddpflow: error: <bad> & worse)\n")
    lines = (out / "leaderboard.csv").read_text().splitlines()
    assert lines[0].split(",") == (COLUMNS[:3] + ["variant", "param:stages.1.lr"]
                                   + COLUMNS[3:])
    assert [ln.split(",")[:5] for ln in lines[1:]] == [
        ["1", ids["best"], "True", "", "0.1"], ["2", ids["low"], "False", "", "0.01"],
        ["3", ids["bad"], "False", "", "1.0"]]
    assert drawn["metric_vs_stages_1_lr.png"] == {
        "xscale": "log", "xlabel": "stages.1.lr", "ylabel": "best val_acc",
        "title": "val_acc per trial (red: best)", "dpi": 100, "size": (6.0, 4.0),
        "xticks": drawn["metric_vs_stages_1_lr.png"]["xticks"],
        "tickstyle": drawn["metric_vs_stages_1_lr.png"]["tickstyle"],
        "marks": drawn["metric_vs_stages_1_lr.png"]["marks"],
        "xlocs": drawn["metric_vs_stages_1_lr.png"]["xlocs"],
        "points": [[[0.1, 0.9], [0.01, 0.6]]], "colours": [["#d62728", "#1f77b4"]],
        "lines": [], "legend": None}
    wall = drawn["metric_vs_wall_time.png"]
    assert (wall["xscale"], wall["xlabel"], wall["points"]) == (
        "log", "wall time (s)", [[[40.0, 0.9], [3.0, 0.6]]])


def test_the_report_shows_the_table_the_best_trial_and_the_plots(tmp_path):
    from ddpflow.sweeps.leaderboard import collect

    cfg, trials, ids = _board(tmp_path)
    collect(cfg)
    out = cfg.run_dir / "sweep"
    html = (out / "report.html").read_text()
    board = json.loads((out / "leaderboard.json").read_text())
    best = board["trials"][0]
    assert html.startswith('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                           '<title>ddpflow sweep: t</title>')
    assert '<h1>ddpflow sweep <code>t</code>: 3 trial(s)</h1>' in html
    assert (f"<p>Best trial <b>{ids['best']}</b>: val_acc 0.9000, weights "
            f"<code>{best['weights']}</code></p>") in html
    head = ("<tr><th>rank</th><th>trial</th><th>stages.1.lr</th><th>status</th>"
            "<th>best value</th><th>final value</th><th>wall time (s)</th><th>samples/s</th>"
            "<th>GPU-hours</th><th>report</th></tr>")
    assert f'<table id="leaderboard">{head}' in html
    link = f"../trials/{ids['best']}/summary/report.html"
    assert (f'<tr class="ok"><td>1</td><td>&#9733; {ids["best"]}</td><td>0.1000</td>'
            f'<td>finished</td><td>0.9000</td><td>0.8500</td><td>40.0</td><td>–</td>'
            f'<td>0.0111</td><td><a href="{link}">report</a></td></tr>') in html
    assert (f'<tr><td>3</td><td>{ids["bad"]}</td><td>1.0000</td><td>failed: stage a: '
            f'ddpflow: error: &lt;bad&gt; &amp; worse</td><td>–</td><td>–</td><td>–</td>'
            f'<td>–</td><td>0.0000</td><td>–</td></tr>') in html
    figs = html.split("<h2>Plots</h2>")[1]
    assert figs.count("<figure><img alt=") == 2
    assert "<figcaption>stages.1.lr</figcaption>" in figs
    assert "<figcaption>wall_time_s</figcaption>" in figs
    assert html.endswith("</body></html>\n")


def test_collect_reads_the_trials_logs_where_it_is_told(tmp_path):
    from ddpflow.sweeps.leaderboard import collect

    cfg, trials, ids = _board(tmp_path)
    logs = tmp_path / "elsewhere"
    (logs / ids["bad"]).mkdir(parents=True)
    (logs / ids["bad"] / "train_a.log").write_text("ddpflow: error: from elsewhere\n")
    assert collect(cfg, logs).endswith(f"  {ids['bad']}: failed (stage a: ddpflow: error: "
                                       f"from elsewhere)\n")
    assert collect(cfg, str(logs)).endswith("from elsewhere)\n")


def test_a_board_with_no_finished_trial_says_so(tmp_path, drawn):
    from ddpflow.sweeps.leaderboard import collect

    cfg, trials = _sweep(tmp_path, {"stages.1.lr": [0.1, 0.2]}, stages=TWO_STAGES)
    text = collect(cfg)
    out = cfg.run_dir / "sweep"
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["best"] is None and board["figures"] == [] and drawn == {}
    html = (out / "report.html").read_text()
    assert '<p class="bad">No trial finished.</p>' in html
    assert "<h2>Plots</h2><p>No trial finished yet.</p>" in html
    assert text.splitlines()[0] == f"ddpflow sweep 't': 0/2 trial(s) finished: " \
                                   f"{out / 'report.html'}"
    assert len(text.splitlines()) == 3 and "best" not in text


def test_values_that_are_not_numbers_are_categories_on_their_axis(tmp_path, drawn):
    import matplotlib.pyplot as plt

    from ddpflow.sweeps.leaderboard import _plots

    plt.close("all")
    rows = [{"trial": "a", "status": "finished", "best_value": 0.5, "monitor": None,
             "best": False, "param:k": "sgd", "param:n": 2, "param:b": True,
             "wall_time_s": 5.0, "param:m": 1},
            {"trial": "b", "status": "finished", "best_value": 0.7, "monitor": "y",
             "best": True, "param:k": "adam", "param:n": 3, "param:b": False,
             "wall_time_s": 10.0, "param:m": "a long text that slants below the axis"},
            {"trial": "c", "status": "finished", "best_value": None, "monitor": "x",
             "best": False, "param:k": "zzz", "param:n": 1, "param:b": True,
             "wall_time_s": 1.0},
            {"trial": "d", "status": "failed", "best_value": 0.1, "monitor": "x",
             "best": False, "param:k": "yyy", "param:n": 1, "param:b": True,
             "wall_time_s": 1.0}]
    figures = _plots(rows, ["k", "n", "b", "m"], tmp_path)
    assert figures == {"k": tmp_path / "metric_vs_k.png", "n": tmp_path / "metric_vs_n.png",
                       "b": tmp_path / "metric_vs_b.png", "m": tmp_path / "metric_vs_m.png",
                       "wall_time_s": tmp_path / "metric_vs_wall_time.png"}
    assert drawn["metric_vs_m.png"]["xticks"] == [  # one text among numbers
        '"a long text that slants below the axis"', "1"]
    assert all(drawn[f"{name.name}:fits"] for name in figures.values())
    assert plt.get_fignums() == []  # each figure closed once saved
    k = drawn["metric_vs_k.png"]
    assert (k["xticks"], k["points"], k["xscale"]) == (
        ['"adam"', '"sgd"'], [[[1.0, 0.5], [0.0, 0.7]]], "linear")
    # named as the first finished row names it (collect hands them ranked: the best)
    assert (k["ylabel"], k["title"]) == ("best value", "value per trial (red: best)")
    assert drawn["metric_vs_b.png"]["xticks"] == ["false", "true"]
    assert k["tickstyle"] == [(30.0, 8.0)] * 2  # long texts slanted, small
    n = drawn["metric_vs_n.png"]
    assert (n["xscale"], n["points"]) == ("linear", [[[2.0, 0.5], [3.0, 0.7]]])
    assert drawn["metric_vs_wall_time.png"]["xscale"] == "linear"  # 5 to 10: no decade
    rows[0]["wall_time_s"], rows[1]["wall_time_s"] = 0.0, 100.0
    _plots(rows, [], tmp_path)
    assert drawn["metric_vs_wall_time.png"]["xscale"] == "linear"  # 0 has no log
    rows[0]["wall_time_s"] = 10.0
    _plots(rows, [], tmp_path)
    assert drawn["metric_vs_wall_time.png"]["xscale"] == "log"  # exactly a decade
    rows[0]["wall_time_s"], rows[1]["wall_time_s"] = 1.0, 9.5
    _plots(rows, [], tmp_path)
    assert drawn["metric_vs_wall_time.png"]["xscale"] == "linear"  # under a decade


def test_the_board_is_logged_to_the_sweeps_mlflow_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from ddpflow.sweeps.leaderboard import collect
    from ddpflow.tracking import mlflowrun

    monkeypatch.chdir(tmp_path)  # a SQLite store keeps artifacts in ./mlruns
    db = f"sqlite:///{tmp_path}/mlflow.db"
    cfg, trials, ids = _board(tmp_path, tracking={"mlflow": {"uri": db}})
    # a plain run of this name once kept metrics it could not send: they are that run's,
    # not the sweep's, and stay where they are
    kept = cfg.stage_dir("a") / mlflowrun.UNSENT
    kept.parent.mkdir(parents=True)
    kept.write_text('["metrics", {"step": 5, "ts": 0, "values": {"train/loss": 1.5}}]\n')
    collect(cfg)
    c = MlflowClient(tracking_uri=db)
    (run,) = c.search_runs([c.get_experiment_by_name("ddpflow").experiment_id])
    assert (run.info.run_name, run.info.status) == ("t", "FINISHED")
    assert capsys.readouterr().err.endswith(
        f"\nddpflow: MLflow: logged to run {run.info.run_id} at {db}\n")
    assert kept.is_file()
    assert sorted(a.path for a in c.list_artifacts(run.info.run_id)) == [
        "headline.txt", "leaderboard.csv", "leaderboard.json", "metric_vs_stages_1_lr.png",
        "metric_vs_wall_time.png", "report.html"]


def test_a_collect_that_fails_keeps_no_part_of_the_board(tmp_path, monkeypatch):
    """A write that fails (or Ctrl-C) part-way: no old or new file of the board is left."""
    from ddpflow.sweeps import leaderboard

    cfg, trials, ids = _board(tmp_path)
    out = cfg.run_dir / "sweep"
    leaderboard.collect(cfg)
    real = leaderboard.write_text_atomic

    def failing(path, *a, **kw):
        if Path(path).name == "report.html":
            raise KeyboardInterrupt
        return real(path, *a, **kw)

    monkeypatch.setattr(leaderboard, "write_text_atomic", failing)
    with pytest.raises(KeyboardInterrupt):
        leaderboard.collect(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["plan.json"]


def test_the_schedules_line_says_what_it_spent():
    from ddpflow.sweeps.leaderboard import schedule_text

    s = {"scheduler": "asha", "spent_epochs": 12, "full_epochs": 27,
         "resource": "epochs of stage b of x", "fraction": 0.4444, "rungs": [1, 3, 9]}
    assert schedule_text(s) == ("asha: 12 of 27 trial-epochs of stage b of x (0.4444 of "
                                "running every trial to its end), rungs at epoch(s) 1, 3, 9")
    assert schedule_text({**s, "scheduler": "none"}).startswith("tpe: 12 of 27")


# ------------------------------------------------------------------ a scheduled sweep's board

NINE = [{"name": "s1", "epochs": 9, "batch_size": 32, "lr": 0.05}]


def _asha(tmp_path, **sweep):
    """An ASHA sweep (rungs 1, 3, 9) of five trials, as the scheduler left it: lr 0.1
    finished (0.8), 0.2 paused at rung 3 (0.7), 0.3 pruned, 0.4 stopped on its way to 3,
    0.5 not started (no record)."""
    from ddpflow.sweeps import schedstate
    from ddpflow.sweeps.asha import TrialState

    grid = {"stages.0.lr": [0.1, 0.2, 0.3, 0.4, 0.5]}
    cfg = from_dict(tiny_config(tmp_path, stages=NINE, hardware={"device": "cpu"},
                                sweep={"grid": grid, "scheduler": "asha", **sweep}))
    P.write_plan(cfg, P.plan(cfg))
    entries = P.read_plan(cfg)["trials"]
    ids = {e["overrides"]["stages.0.lr"]: e["id"] for e in entries}
    states = [TrialState(ids[0.1], {"stages.0.lr": 0.1}, None, 0, "k", {1: 0.5, 3: 0.6, 9: 0.8},
                         9, 9),
              TrialState(ids[0.2], {"stages.0.lr": 0.2}, None, 1, "k", {1: 0.6, 3: 0.7}, 3, 3),
              TrialState(ids[0.3], {"stages.0.lr": 0.3}, None, 2, "k", {1: None}, 1, 1,
                         pruned="diverged: loss is NaN", kind="diverged"),
              TrialState(ids[0.4], {"stages.0.lr": 0.4}, None, 3, "k", {1: 0.4, 3: 0.9}, 1, 3)]
    schedstate.write_state(cfg, states, "val_acc", "max", [1, 3, 9])
    t = from_dict(json.loads(P.trial_config_path(cfg, {"id": ids[0.1]}).read_text()))
    _finish(t, "s1", gpus=["0"], wall_time_s=9.0, best_value=0.8)
    return cfg, ids


def test_a_scheduled_trials_row_says_its_rung_and_why_it_stopped(tmp_path):
    from ddpflow.sweeps.leaderboard import trial_row
    from ddpflow.sweeps.scheduleboard import scheduled_rows

    cfg, ids = _asha(tmp_path)
    rows, summary = scheduled_rows(cfg, P.read_plan(cfg), tmp_path / "logs", trial_row)
    got = {r["trial"]: (r["rank"], r["best"], r["status"], r["reason"], r["rung"],
                        r["rung_value"], r["resource_epochs"], r["rung_values"], r["curve"],
                        r["monitor"], r["mode"]) for r in rows}
    assert got == {
        ids[0.1]: (1, True, "finished", "", 9, 0.8, 9, {"1": 0.5, "3": 0.6, "9": 0.8},
                   [[1, 0.5], [3, 0.6], [9, 0.8]], "val_acc", "max"),
        ids[0.2]: (2, False, "paused", "paused at epoch 3 (rung 2 of 3): not in the top of its "
                   "rung; its checkpoint resumes it if it is promoted", 3, 0.7, 3,
                   {"1": 0.6, "3": 0.7}, [[1, 0.6], [3, 0.7]], "val_acc", "max"),
        ids[0.3]: (3, False, "pruned", "diverged: loss is NaN", 1, None, 1, {"1": None},
                   [[1, None]], "val_acc", "max"),
        ids[0.5]: (5, False, "waiting", "not started", None, None, 0, {}, [], "val_acc", "max"),
        ids[0.4]: (4, False, "stopped", "stopped on its way to epoch 3: the next run resumes it",
                   1, 0.4, 1, {"1": 0.4}, [[1, 0.4]], "val_acc", "max")}
    assert [r["trial"] for r in rows][2:] == sorted([ids[0.3], ids[0.4], ids[0.5]])
    assert summary == {"scheduler": "asha", "search": "none", "eta": 3, "rungs": [1, 3, 9],
                       "resource": "epochs of stage s1", "spent_epochs": 14,
                       "full_epochs": 45, "fraction": round(14 / 45, 4)}


def test_a_stale_result_stays_stale_on_a_scheduled_board(tmp_path):
    from ddpflow.sweeps.leaderboard import trial_row
    from ddpflow.sweeps.scheduleboard import scheduled_rows

    cfg, ids = _asha(tmp_path)
    t = from_dict(json.loads(P.trial_config_path(cfg, {"id": ids[0.1]}).read_text()))
    (t.stage_dir("s1") / "final.pt").write_bytes(b"other")
    rows, _ = scheduled_rows(cfg, P.read_plan(cfg), tmp_path / "logs", trial_row)
    row = next(r for r in rows if r["trial"] == ids[0.1])
    assert (row["status"], row["reason"], row["best"]) == (
        "stale", "stage s1: stale: final.pt was replaced after the stage finished", False)
    assert row["monitor"] == "val_acc"  # from its summary


def test_a_paused_trial_between_rungs_and_a_board_without_state(tmp_path):
    from ddpflow.sweeps.asha import TrialState
    from ddpflow.sweeps.leaderboard import trial_row
    from ddpflow.sweeps.scheduleboard import _reason, scheduled_rows

    t = TrialState("x", {}, None, 0, "k", {1: 0.5, 2: 0.6}, 2, 2)
    assert _reason(t, "paused", [1, 3, 9]) == (
        "paused at epoch 2 (between rungs): not in the top of its rung; its checkpoint resumes "
        "it if it is promoted")
    t.epochs = 1
    assert _reason(t, "paused", [1, 3, 9]).startswith("paused at epoch 1 (rung 1 of 3)")
    assert _reason(t, "finished", [1]) == "" and _reason(t, "waiting", [1]) == "not started"
    t.pruned = None
    assert _reason(t, "pruned", [1]) == ""
    cfg = from_dict(tiny_config(tmp_path, stages=NINE, hardware={"device": "cpu"},
                                sweep={"grid": {"stages.0.lr": [0.1, 0.2]},
                                       "variants": [{"name": "v", "set": {"seed": 1}}],
                                       "scheduler": "asha"}))
    P.write_plan(cfg, P.plan(cfg))
    rows, summary = scheduled_rows(cfg, P.read_plan(cfg), tmp_path / "logs", trial_row)
    assert [(r["status"], r["monitor"], r["mode"], r["rung"], r["variant"]) for r in rows] == [
        ("waiting", None, None, None, "v")] * 2
    assert (summary["spent_epochs"], summary["full_epochs"], summary["fraction"]) == (0, 18, 0.0)


def test_scheduled_trials_rank_finished_then_paused_by_rung_then_the_rest():
    from ddpflow.sweeps.scheduleboard import rank

    def r(trial, status, value=None, rung=None, rung_value=None, mode="max"):
        return {"trial": trial, "status": status, "best_value": value, "rung": rung,
                "rung_value": rung_value, "mode": mode}

    rows = rank([r("p1", "paused", rung=1, rung_value=0.99), r("f2", "finished", 0.5),
                 r("p3b", "paused", rung=3, rung_value=0.6),
                 r("p3a", "paused", rung=3, rung_value=0.7), r("f1", "finished", 0.6),
                 r("fn", "finished", float("nan")), r("p0", "paused", rung=None),
                 r("x", "pruned", 0.9, rung=9, rung_value=0.9),
                 r("p3n", "paused", rung=3, rung_value=None)])
    assert [(x["trial"], x["rank"], x["best"]) for x in rows] == [
        ("f1", 1, True), ("f2", 2, False), ("fn", 3, False), ("p3a", 4, False),
        ("p3b", 5, False), ("p3n", 6, False), ("p1", 7, False), ("p0", 8, False),
        ("x", 9, False)]
    rows = rank([r("a", "finished", 0.6, mode="min"), r("b", "finished", 0.5, mode="min"),
                 r("c", "paused", rung=1, rung_value=0.1, mode="min"),
                 r("d", "paused", rung=1, rung_value=0.05, mode="min")])
    assert [x["trial"] for x in rows] == ["b", "a", "d", "c"]
    rows = rank([r("a", "finished", float("nan")), r("b", "paused", rung=1, rung_value=1.0)])
    assert [(x["trial"], x["best"]) for x in rows] == [("a", False), ("b", False)]
    assert rank([r("a", "paused", rung=1, rung_value=1.0)])[0]["best"] is False


def test_a_scheduled_board_shows_the_schedule_and_the_curves(tmp_path, drawn):
    from ddpflow.sweeps import scheduleboard
    from ddpflow.sweeps.leaderboard import COLUMNS, collect

    cfg, ids = _asha(tmp_path)
    text = collect(cfg)
    out = cfg.run_dir / "sweep"
    board = json.loads((out / "leaderboard.json").read_text())
    line = ("asha: 14 of 45 trial-epochs of stage s1 (0.3111 of running every trial to its "
            "end), rungs at epoch(s) 1, 3, 9")
    assert text.splitlines()[1] == f"  {line}"
    assert f"  {ids[0.2]}: paused" not in text and f"  {ids[0.3]}: pruned (diverged" in text
    assert board["schedule"]["spent_epochs"] == 14
    assert board["figures"] == ["metric_vs_epochs.png", "metric_vs_stages_0_lr.png",
                                "metric_vs_wall_time.png"]
    header = (out / "leaderboard.csv").read_text().splitlines()[0].split(",")
    assert header == (COLUMNS[:3] + ["variant", "param:stages.0.lr"] + COLUMNS[3:]
                      + scheduleboard.COLUMNS)
    html = (out / "report.html").read_text()
    assert f"<p>{line}</p>" in html
    assert "<th>status</th><th>rung (epoch)</th><th>epochs trained</th><th>best value" in html
    assert "<td>finished</td><td>9</td><td>9</td><td>0.8000</td>" in html
    assert "<figcaption>epochs</figcaption>" in html
    ep = drawn["metric_vs_epochs.png"]
    red, grey = "#d62728", "#999999"
    vlines = [([r, r], [0.0, 1.0], "#cccccc", 1.0, ":") for r in (1, 3, 9)]
    assert ep["lines"] == [
        ([1.0, 3.0], [0.6, 0.7], grey, 1.0, "-"), ([1.0], [0.4], grey, 1.0, "-"),
        ([1.0, 3.0, 9.0], [0.5, 0.6, 0.8], red, 1.8, "-"), *vlines]
    assert ep["points"] == [[[1.0, 0.6], [3.0, 0.7]], [[1.0, 0.4]],
                            [[1.0, 0.5], [3.0, 0.6], [9.0, 0.8]]]
    assert [c[0] for c in ep["colours"]] == [grey, grey, red]
    # small dots at the rungs, drawn above every line (lines are at zorder 2)
    assert [(sizes, z > 2) for sizes, z in ep["marks"]] == [([14.0], True)] * 3
    assert (ep["xlabel"], ep["ylabel"], ep["title"], ep["legend"], ep["dpi"], ep["size"]) == (
        "epochs of stage s1 (dotted: rungs)", "val_acc",
        "val_acc per trial: 14 of 45 epochs spent (0.3111)",
        [("best", 8.0), ("finished", 8.0), ("paused or pruned", 8.0)], 100, (7.0, 4.5))


def test_the_epochs_plot_of_finished_trials_and_of_none(tmp_path, drawn):
    import matplotlib.pyplot as plt

    from ddpflow.sweeps.scheduleboard import resource_plot

    plt.close("all")
    summary = {"rungs": [1, 3], "resource": "epochs of stage s", "spent_epochs": 4,
               "full_epochs": 6, "fraction": 0.6667}
    rows = [{"curve": [], "best": False, "status": "waiting", "rung_values": {}},
            {"curve": [[1, 0.2], [3, 0.3]], "best": True, "status": "finished",
             "rung_values": {"1": 0.2, "3": 0.3}},
            {"curve": [[1, 0.1], [3, 0.25]], "best": False, "status": "finished",
             "rung_values": {"1": 0.1, "3": None}},
            {"curve": [[1, None]], "best": False, "status": "pruned", "rung_values": {}},
            {"curve": [[1, 0.05]], "best": False, "status": "paused", "rung_values": {}}]
    assert resource_plot(rows, summary, "m", tmp_path) == tmp_path / "metric_vs_epochs.png"
    ep = drawn["metric_vs_epochs.png"]
    # drawn bottom to top: paused and pruned, finished, the best
    assert [ln[:4] for ln in ep["lines"][:3]] == [
        ([1.0], [0.05], "#999999", 1.0), ([1.0, 3.0], [0.1, 0.25], "#1f77b4", 1.0),
        ([1.0, 3.0], [0.2, 0.3], "#d62728", 1.8)]
    assert len(ep["lines"]) == 5 and ep["points"] == [[[1.0, 0.1]], [[1.0, 0.2], [3.0, 0.3]]]
    assert (tmp_path / "metric_vs_epochs.png").read_bytes()[:4] == b"\x89PNG"
    assert drawn["metric_vs_epochs.png:fits"] and plt.get_fignums() == []
    assert all(x.is_integer() for x in ep["xlocs"])  # whole epochs only, even from 1 to 3
    drawn.clear()
    assert resource_plot(rows[:1], summary, "m", tmp_path / "none") is None and drawn == {}


def test_a_tpe_board_has_a_row_per_recorded_draw(tmp_path):
    pytest.importorskip("optuna")
    from ddpflow.sweeps import schedstate
    from ddpflow.sweeps.asha import TrialState
    from ddpflow.sweeps.leaderboard import trial_row
    from ddpflow.sweeps.scheduleboard import scheduled_rows

    space = {"stages.0.lr": {"log_uniform": [0.01, 0.1]}}
    cfg = _cfg(tmp_path, search="tpe", random={"samples": 4, "space": space})
    P.write_plan(cfg, P.plan(cfg))
    draws = [TrialState("lr-0.05-aaaaaa", {"stages.0.lr": 0.05}, None, 0, "k", {2: 0.5}, 2, 2),
             TrialState("lr-0.02-bbbbbb", {"stages.0.lr": 0.02}, None, 1)]
    for t in draws:  # the scheduler writes each draw's config as it makes it
        trial = Trial(t.id, t.overrides, None)
        P.write_trial_config(cfg, trial, P.resolve(cfg, cfg.to_dict(), trial))
    schedstate.write_state(cfg, draws, "val_acc", "max", [2])
    rows, summary = scheduled_rows(cfg, P.read_plan(cfg), tmp_path / "logs", trial_row)
    assert [(r["trial"], r["overrides"], r["variant"], r["status"]) for r in rows] == [
        ("lr-0.05-aaaaaa", {"stages.0.lr": 0.05}, None, "finished"),
        ("lr-0.02-bbbbbb", {"stages.0.lr": 0.02}, None, "waiting")]
    assert (summary["scheduler"], summary["search"], summary["full_epochs"]) == ("none", "tpe", 4)

"""Imbalanced data and the recipes beyond crop: data.sampling (uniform, balanced, weights,
with and without replacement), repeated augmentation, the augmentation policies, the
evaluation crop and interpolation, the step schedules, lr_min and norm_weight_decay, and
the metrics that show imbalance (per-class recall, balanced accuracy). Units here; real
torchrun runs resumed on other rank counts in test_sampling_runs.py."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpflow.core.errors import UserError
from ddpflow.data import policies
from ddpflow.data.crops import EvalCrop, center_crop, crop_resize, eval_resize
from ddpflow.data.sampling import (
    Draws,
    EpochSampler,
    Spec,
    check_balanced,
    dataset_labels,
    spec_of,
)
from ddpflow.seams.sampleweights import check_weights

# 100:10:1 between the largest and the smallest class
LONG_TAIL = np.repeat(np.arange(3), [500, 50, 5])


def counts(idx, labels=LONG_TAIL) -> list[int]:
    return np.bincount(labels[np.asarray(idx)], minlength=3).tolist()


# --------------------------------------------------------------------------- the draws
def test_uniform_without_replacement_is_the_permutation_ddpflow_always_drew():
    """The default draws what it drew before data.sampling existed: numbers do not move."""
    for epoch in (0, 3):
        g = torch.Generator()
        g.manual_seed(7 + epoch)
        want = torch.randperm(555, generator=g)
        assert torch.equal(Draws(555)(7, epoch), want)
        old = want[:552].view(23, 1, 2, 12)[:, :, 1].reshape(-1)[24:].tolist()  # rank 1
        s = EpochSampler(555, 2, 1, 7, batch=12, draws=Spec().draws(LONG_TAIL))
        s.set_epoch(epoch, 24)
        assert list(s) == old and len(s) == len(old)
    assert Spec().draws(LONG_TAIL) is None  # no sequence of its own


def test_balanced_with_replacement_draws_each_class_equally_often():
    d = Spec("balanced", True).draws(LONG_TAIL)
    assert d.length == len(LONG_TAIL)
    seen = Counter()
    for epoch in range(8):
        seen.update(dict(enumerate(counts(d(3, epoch)))))
    total = 8 * len(LONG_TAIL)
    for c in range(3):  # 1/3 each, within 4 standard deviations of the binomial
        assert abs(seen[c] - total / 3) < 4 * math.sqrt(total * (1 / 3) * (2 / 3)), seen
    assert torch.equal(d(3, 5), d(3, 5))  # a function of (seed, epoch) alone
    assert not torch.equal(d(3, 5), d(3, 6)) and not torch.equal(d(3, 5), d(4, 5))
    small = d(3, 0)[LONG_TAIL[d(3, 0).numpy()] == 2]
    assert set(small.tolist()) <= set(range(550, 555))  # class 2's own samples


def test_balanced_without_replacement_takes_the_smallest_count_of_every_class():
    d = Spec("balanced", False).draws(LONG_TAIL)
    assert d.length == 3 * 5
    a, b = d(0, 0), d(0, 1)
    assert len(a) == 15 and len(set(a.tolist())) == 15 and counts(a) == [5, 5, 5]
    assert set(a.tolist()) != set(b.tolist())  # another subset of the large classes
    assert torch.equal(a, d(0, 0))


def test_weights_follow_the_weights_and_zero_is_never_drawn():
    w = np.zeros(len(LONG_TAIL))
    w[[3, 4, 5]] = [1.0, 3.0, 0.0]
    w[600 - 50:] = 0
    with_r = Spec("weights", True, weights=w).draws(LONG_TAIL)
    got = Counter(with_r(1, 0).tolist())
    assert set(got) == {3, 4} and with_r.length == len(LONG_TAIL)
    assert abs(got[4] / len(LONG_TAIL) - 0.75) < 4 * math.sqrt(0.75 * 0.25 / len(LONG_TAIL))
    w = np.arange(len(LONG_TAIL), dtype=np.float64)  # sample 0 weight 0, the rest rising
    without = Spec("weights", False, weights=w).draws(LONG_TAIL)
    order = without(2, 0)
    assert without.length == len(LONG_TAIL) - 1 and sorted(order.tolist()) == list(range(1, 555))
    first = order[:100].float().mean()
    assert first > 340, first  # heavier first: 2/3 of 554 expected; uniform gives 277 +- 16


def test_uniform_with_replacement_repeats_samples():
    d = Spec("uniform", True).draws(LONG_TAIL)
    a = d(0, 0)
    assert len(a) == len(LONG_TAIL) and len(set(a.tolist())) < len(a)
    assert torch.equal(a, d(0, 0))


def test_replacement_follows_the_mode_unless_set():
    data = SimpleNamespace(sampling="balanced", sampling_replacement=None, repeated_augment=3)
    assert spec_of(data).replacement and spec_of(data).repeats == 3
    assert not spec_of(SimpleNamespace(**{**vars(data), "sampling": "uniform"})).replacement
    assert not spec_of(SimpleNamespace(**{**vars(data), "sampling_replacement": False})
                       ).replacement


def test_a_class_without_samples_cannot_be_balanced():
    with pytest.raises(UserError, match=r"data.sampling balanced: class 1 has no sample in the "
                                        r"training split \(2 of the 4 classes have none\)"):
        Spec("balanced", True, num_classes=4).draws(np.array([0, 0, 2, 2]))
    check_balanced(np.array([0, 1, 2]), 3, "x")  # every class: nothing to say


# --------------------------------------------------------------------------- slots, ranks
def steps(world, accum, spec, start=0, n=100, batch=4, keyed=False):
    """Per optimizer step, its slots' samples in slot order (every rank's sampler)."""
    labels = np.arange(n) % 4
    per_rank = []
    for r in range(world):
        s = EpochSampler(n, world, r, 3, batch, accum, spec.draws(labels), spec.repeats)
        s.keyed = keyed
        s.set_epoch(2, start * accum * batch)
        per_rank.append(list(s))
    out = []
    for t in range(len(per_rank[0]) // (batch * accum)):
        slots = {}
        for r in range(world):
            for m in range(accum):
                at = (t * accum + m) * batch
                slots[m * world + r] = per_rank[r][at:at + batch]
        out.append([slots[v] for v in sorted(slots)])
    return out


SPECS = [Spec("uniform", True), Spec("balanced", True), Spec("balanced", False),
         Spec("weights", True, weights=np.linspace(0, 1, 100)),
         Spec("weights", False, weights=np.linspace(0, 1, 100)),
         Spec("balanced", True, repeats=2), Spec("uniform", False, repeats=3)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-{s.replacement}-{s.repeats}")
def test_every_sampling_puts_each_draw_in_one_slot_on_any_number_of_ranks(spec):
    """The epoch's sequence is cut the same way whoever trains it: 1, 2 or 4 ranks with the
    accumulation that keeps the global batch see the same slots; no two ranks share a
    draw; resumed after 2 steps, the rest exactly."""
    whole = steps(2, 2, spec)
    assert steps(1, 4, spec) == steps(4, 1, spec) == whole and len(whole) > 2
    assert steps(4, 1, spec, start=2) == whole[2:]
    labels = np.arange(100) % 4
    seq = EpochSampler(100, 1, 0, 3, 16, 1, spec.draws(labels), spec.repeats)
    seq.set_epoch(2)
    assert [i for step in whole for slot in step for i in slot] == seq.order().tolist()


def test_repeated_augmentation_puts_each_copy_in_another_slot_and_keeps_the_epoch():
    whole = steps(2, 2, Spec("uniform", False, repeats=2))  # 4 slots of 4: 8 draws, twice
    plain = steps(2, 2, Spec("balanced", True))
    assert len(whole) == len(plain) == len(steps(2, 2, Spec("balanced", True, repeats=2))) \
        == 100 // 16  # the epoch keeps its steps
    for step in whole:
        where = {}
        for slot, samples in enumerate(step):
            for i in samples:
                where.setdefault(i, []).append(slot)
        assert len(where) == 8 and all(len(set(s)) == 2 for s in where.values()), where
    odd = steps(1, 1, Spec("uniform", False, repeats=3), batch=16)  # 16 = 6 + 6 + 4
    assert sorted(Counter(odd[0][0]).values()) == [2] * 2 + [3] * 4


def test_each_draw_keeps_its_augmentation_key_on_any_number_of_ranks():
    spec = Spec("balanced", True, repeats=2)
    one, two = steps(1, 2, spec, keyed=True), steps(2, 1, spec, keyed=True)
    assert one == two
    keys = [k for step in one for slot in step for _, k in slot]
    assert len(set(keys)) == len(keys)  # copies of a draw augmented apart
    other = EpochSampler(100, 1, 0, 3, 4, 1)
    other.set_epoch(3)
    assert set(other.keys(range(5))).isdisjoint(keys)  # another epoch, other seeds


# --------------------------------------------------------------------------- the seam
WEIGHT_ROWS = [
    # class, returned, words of the one message
    ("negative", [1.0, -0.5, 1.0], "returned weight 1 = -0.5"),
    ("NaN", np.array([1.0, np.nan, 1.0]), "returned weight 1 = nan"),
    ("inf", torch.tensor([np.inf, 1.0, 1.0]), "returned weight 0 = inf"),
    ("all zero", [0, 0, 0], "returned all 3 weights 0"),
    ("wrong length", [1.0, 1.0], "returned a list of 2: (float 1.0, float 1.0); expected 3"),
    ("2-D", np.ones((3, 1)), "returned a ndarray of shape (3, 1) (float64); expected 3"),
    ("strings", ["a", "b", "c"], "expected 3 weights, one per training sample"),
    ("a dict", {"a": 1}, "returned a dict with keys a; expected 3 weights"),
    ("None", None, "returned NoneType None; expected 3 weights"),
]


@pytest.mark.parametrize("cls,value,words", WEIGHT_ROWS, ids=[r[0] for r in WEIGHT_ROWS])
def test_weights_that_break_the_contract_are_one_message(cls, value, words):
    with pytest.raises(UserError) as e:
        check_weights(value, 3, "data.sample_weights w:bad")
    assert str(e.value).startswith("data.sample_weights w:bad returned ") and words in str(e.value)
    assert "\n" not in str(e.value)


def test_good_weights_come_back_as_float64():
    got = check_weights(torch.tensor([0, 2, 1]), 3, "w")
    assert got.dtype == np.float64 and got.tolist() == [0.0, 1.0, 0.5]  # largest 1
    huge = check_weights([1e308, 1e308, 5e307], 3, "w")  # their sum would overflow
    assert np.isfinite(huge.sum()) and huge.tolist() == [1.0, 1.0, 0.5]
    assert check_weights([True, False, True], 3, "w").tolist() == [1.0, 0.0, 1.0]


def test_a_user_datasets_targets_give_its_classes():
    class Ds(list):
        targets = torch.tensor([0, 2, 1])

    assert dataset_labels(Ds([1, 2, 3]), "f").tolist() == [0, 2, 1]
    assert dataset_labels([1, 2], "f") is None
    Ds.targets = [0.5, 1, 2]
    with pytest.raises(UserError, match=r"f: the dataset's `targets` is float64 of shape "
                                        r"\(3,\); data.sampling needs one class index"):
        dataset_labels(Ds([1, 2, 3]), "f")


# --------------------------------------------------------------------------- policies
@pytest.mark.parametrize("name", policies.NAMES)
def test_a_policy_draws_from_its_keys_alone(name):
    aug = SimpleNamespace(policy=name, num_ops=None, magnitude=None)
    policy = policies.build(aug)
    x = torch.randint(0, 256, (4, 20, 20, 3), dtype=torch.uint8)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = policies.apply(policy, x, [1, 2, 3, 4])
    assert torch.equal(torch.rand(3), before)  # nothing else's random stream moved
    b = policies.apply(policy, x, [1, 2, 3, 4])
    assert torch.equal(a, b) and a.shape == x.shape and a.dtype == torch.uint8
    c = policies.apply(policy, x, [5, 6, 7, 8])
    assert not torch.equal(a, c) and not torch.equal(a, x)
    gray = policies.apply(policy, x[..., :1].contiguous(), [1, 2, 3, 4])
    assert gray.shape == (4, 20, 20, 1)


def test_policies_are_torchvisions_with_their_settings():
    from torchvision.transforms import v2

    def build(**kw):
        return policies.build(SimpleNamespace(**{"num_ops": None, "magnitude": None, **kw}))

    assert build(policy=None) is None
    assert isinstance(build(policy="trivialaugment"), v2.TrivialAugmentWide)
    ra = build(policy="randaugment", num_ops=3, magnitude=12)
    assert isinstance(ra, v2.RandAugment) and (ra.num_ops, ra.magnitude) == (3, 12)
    assert (build(policy="randaugment").num_ops, build(policy="randaugment").magnitude) == (2, 9)
    assert build(policy="augmix").severity == 3 and build(policy="augmix", magnitude=7
                                                          ).severity == 7


# --------------------------------------------------------------------------- crops
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [9, 23, 40])
def test_the_crop_resamples_as_pytorchs_antialiased_resize(mode, size):
    """A box that is the whole image, resampled by crop_resize, is F.interpolate's
    antialiased resize of it with the same filter (shrinking and growing)."""
    x = torch.rand(2, 3, 24, 24, dtype=torch.float64)
    boxes = torch.tensor([[0, 0, 24, 24]] * 2)
    got = crop_resize(x, boxes, size, mode=mode)
    want = F.interpolate(x, size=(size, size), mode=mode, antialias=True, align_corners=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # torch's weights: float32
    if mode == "bicubic":  # and not the bilinear one
        assert (got - crop_resize(x, boxes, size)).abs().max() > 1e-3


def test_the_evaluation_crop_takes_the_sizes_it_is_given():
    x = torch.rand(1, 3, 40, 40)
    assert center_crop(x, 32).shape[-1] == 32 and eval_resize(32) == 37
    ec = EvalCrop(24, 30, "bicubic")
    want = F.interpolate(x, size=(30, 30), mode="bicubic", antialias=True)[..., 3:27, 3:27]
    torch.testing.assert_close(ec(x), want)
    assert ec.describe() == "resize to 30 (bicubic, antialiased), centre crop 24"
    assert EvalCrop(32).describe() == ("resize to 37 (bilinear, antialiased) unless already "
                                       "32, centre crop 32")
    same = torch.rand(1, 3, 32, 32)
    assert EvalCrop(32)(same) is same  # nothing stored beyond the crop: as it is
    grown = EvalCrop(32, 36)(same)  # an explicit resize is done even then
    torch.testing.assert_close(grown, F.interpolate(same, size=(36, 36), mode="bilinear",
                                                    antialias=True)[..., 2:34, 2:34])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5),
                       st.booleans(), st.text(max_size=2), st.none()), max_size=6),
    st.builds(np.array, st.lists(st.floats(), max_size=6)),
    st.builds(lambda s: np.zeros(s), st.tuples(st.integers(0, 3), st.integers(0, 3))),
    st.floats(), st.text(max_size=3), st.dictionaries(st.text(max_size=2), st.integers())))
def test_property_any_weights_are_accepted_or_one_message(value):
    """Whatever a weights callable returns: float64 weights for 4 samples, or one
    UserError naming the callable, never another exception."""
    try:
        got = check_weights(value, 4, "data.sample_weights w:any")
    except UserError as e:
        assert str(e).startswith("data.sample_weights w:any returned ") and "\n" not in str(e)
        return
    assert got.shape == (4,) and np.isfinite(got).all() and (got >= 0).all() and got.max() == 1


# --------------------------------------------------------------------------- user datasets
USER_SET = '''
import torch
from torch.utils.data import Dataset


class Tail(Dataset):
    def __init__(self, counts, targets=True):
        self.y = [k for k, c in enumerate(counts) for _ in range(c)]
        if targets:
            self.targets = list(self.y)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.full((2,), float(self.y[i])), self.y[i]


def make(split, targets=True):
    return Tail([60, 6, 2] if split == "train" else [2, 2, 2], targets)
'''


def test_a_user_dataset_draws_balanced_from_its_targets(tmp_path):
    """data.source python: the factory's `targets` give the classes the draws balance;
    without them, balanced sampling is one message naming the factory."""
    from ddpflow.config import from_dict
    from ddpflow.data.pipeline import _user_dataset

    (tmp_path / "tail.py").write_text(USER_SET)
    raw = {"data": {"source": "python", "factory": "tail:make", "code_dir": str(tmp_path),
                    "sampling": "balanced", "num_workers": 0},
           "task": "classification", "stages": [{"name": "a"}]}
    d = SimpleNamespace(device=torch.device("cpu"), world=1, rank=0)
    meta = {"kind": "python", "counts": {}}
    data = _user_dataset(from_dict(raw), d, meta, 8, None, 1)
    seen = Counter()
    for _, y in data.train.epoch(0):
        seen.update(y.tolist())
    assert len(data.train) == 68 // 8 and sum(seen.values()) == 64
    assert all(abs(seen[k] - 64 / 3) < 4 * math.sqrt(64 * 2 / 9) for k in range(3)), seen
    raw["data"]["kwargs"] = {"targets": False}
    with pytest.raises(UserError, match=r"data.sampling balanced draws each class equally "
                                        r"often, and the data.factory tail:make dataset does "
                                        r"not say its samples' classes; give it `targets`"):
        _user_dataset(from_dict(raw), d, meta, 8, None, 1)


@pytest.mark.parametrize("keys, seed", [
    ((0,), 6569863346532939966),  # its 64th bit was set: masked to 63 bits
    ((1,), 7434755675892716031),  # odd: every bit of the low word is kept
    ((0, 1, 2), 3071860871404845570),
    ((7, 3, -1), 974896293702283019),  # a negative key is taken modulo 2**64
    ((5,), 3408106289409078375), ((2**64 + 5,), 3408106289409078375)])
def test_a_derived_seed_is_the_same_on_every_machine(keys, seed):
    """core/seeds.seed_sequence pinned: a resumed or requeued run on another machine (or
    numpy) draws the same data order only if these values never change."""
    from ddpflow.core.seeds import seed_sequence

    assert seed_sequence(*keys) == seed and 0 <= seed < 2**63


def test_a_policy_over_no_keys_returns_the_batch_as_it_is():
    """policies.apply with no kept samples (every sample of a batch dropped as bad) hands the
    batch back untouched, without drawing anything."""
    import torch

    from ddpflow.data import policies

    x = torch.randint(0, 255, (0, 8, 8, 3), dtype=torch.uint8)
    state = torch.random.get_rng_state()
    assert policies.apply(lambda img: img.flip(-1), x, []) is x
    assert torch.equal(torch.random.get_rng_state(), state)

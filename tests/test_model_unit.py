"""engine/weights.py, engine/build.py, engine/modelcheck.py, engine/throughput.py and
engine/efficiency.py, edge by edge, on tiny CPU models: what a weights file may hold and the
one message when it does not fit (the head rule, aux heads, the cut list, NaN tensors,
DDP prefixes, safetensors), freezing, a stage's starting weights and their report and log
line; the parts a stage is built from; what validate refuses of a model; a throughput
measurement; FLOP counting, peaks and the passes that leave no trace. Fast: no training run.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.engine import weights


class Tiny(nn.Module):
    def __init__(self, classes=3, width=4):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.backbone(x))


class Aux(nn.Module):
    """A body, an auxiliary classifier and the head (GoogLeNet/Inception style)."""

    def __init__(self, classes=3, width=4, body=3):
        super().__init__()
        self.body = nn.Linear(body, width)
        self.aux = nn.Linear(width, classes)
        self.head = nn.Linear(width, classes)


class Layers(nn.Module):
    def __init__(self, n, width):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])
        self.head = nn.Linear(width, 3)


def _sd(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _refusal(fn, *args) -> str:
    with pytest.raises(UserError) as e:
        fn(*args)
    return str(e.value)


# --------------------------------------------------------------------------- reading files

def test_a_missing_weights_file_says_what_to_give(tmp_path):
    assert _refusal(weights.read_state_dict, tmp_path / "w.pt", "model.weights") == (
        f"model.weights: {tmp_path / 'w.pt'} does not exist; give the weights file (.pt, .pth, "
        f".safetensors or a ddpflow final.pt/best.pt)")


def test_safetensors_files_are_read_and_a_broken_one_is_named(tmp_path):
    from safetensors.torch import save_file

    sd = {f"module.{k}": v.contiguous() for k, v in _sd(Tiny()).items()}
    save_file(sd, str(tmp_path / "w.safetensors"))
    got = weights.read_state_dict(tmp_path / "w.safetensors", "model.weights")
    assert set(got) == {k[len("module."):] for k in sd}
    assert all(torch.equal(got[k[len("module."):]], v) for k, v in sd.items())
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    assert _refusal(weights.read_state_dict, tmp_path / "bad.safetensors", "model.weights") == (
        f"model.weights: {tmp_path / 'bad.safetensors'} cannot be read as safetensors "
        f"(SafetensorError: Error while deserializing header: header too small)")
    # a torch file named .safetensors is not read as torch
    torch.save(_sd(Tiny()), tmp_path / "torch.safetensors")
    assert "cannot be read as safetensors" in _refusal(
        weights.read_state_dict, tmp_path / "torch.safetensors", "model.weights")


def test_safetensors_without_the_package_says_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "w.safetensors").write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # not installed here
    assert _refusal(weights.read_state_dict, tmp_path / "w.safetensors", "model.weights") == (
        f"model.weights: {tmp_path / 'w.safetensors'} is a .safetensors file and the "
        f"safetensors package is not installed here: pip install safetensors")


def test_only_a_wholly_ddp_prefixed_file_loses_its_prefix(tmp_path):
    sd = {"module.a.weight": torch.ones(2), "b.weight": torch.ones(2)}
    torch.save(sd, tmp_path / "mixed.pt")
    assert set(weights.read_state_dict(tmp_path / "mixed.pt", "model.weights")) == set(sd)
    torch.save({"module.a.weight": torch.ones(2)}, tmp_path / "ddp.pt")
    assert set(weights.read_state_dict(tmp_path / "ddp.pt", "model.weights")) == {"a.weight"}


def test_a_file_with_nan_is_named_with_its_tensor(tmp_path):
    sd = _sd(Tiny())
    sd["head.bias"][1:] = float("inf")
    torch.save(sd, tmp_path / "w.pt")
    assert _refusal(weights.read_state_dict, tmp_path / "w.pt", "model.weights") == (
        f"model.weights: {tmp_path / 'w.pt'}: tensor 'head.bias' holds 2 NaN/inf of its 3 "
        f"values; the starting weights are broken (not a learning-rate problem): save them "
        f"again from a healthy model")


def test_finite_checks_floats_and_complex_and_passes_integers():
    weights.check_finite({"n": torch.tensor([1, 2]), "f": torch.ones(2),
                          "c": torch.ones(2, dtype=torch.complex64)}, "w")
    assert _refusal(weights.check_finite, {"f": torch.ones(2), "c": torch.tensor(
        [1 + 1j, complex("inf")])}, "w").startswith("w: tensor 'c' holds 1 NaN/inf of its 2")
    assert _refusal(weights.check_finite, {"f": torch.tensor([float("nan")])}, "w").startswith(
        "w: tensor 'f' holds 1 NaN/inf of its 1 values;")


# --------------------------------------------------------------------------- the head rule

def test_the_final_layer_is_the_last_with_a_weight_or_bias():
    names = ["body.0.weight", "body.0.bias", "head.0.weight", "head.0.bias", "head.1.weight",
             "head.1.bias", "norm.running_mean"]
    assert weights.final_layer(names) == {"head.1.weight", "head.1.bias"}
    assert weights.final_layer(iter(["a.weight", "b.weight", "b.bias"])) == {"b.weight",
                                                                           "b.bias"}
    assert weights.final_layer(["weight", "bias", "x.y"]) == {"weight", "bias"}
    assert weights.final_layer(["norm.running_mean"]) == set() == weights.final_layer([])
    assert weights._layer("a.b.weight") == "a.b" and weights._layer("weight") == ""


def test_an_aux_head_of_another_class_count_starts_fresh():
    model = Aux()
    before = _sd(model)
    sd = _sd(Aux(classes=5))
    report = weights.load_pretrained(model, sd, "model.weights w.pt")
    assert report == {"loaded": 2, "skipped": 4,
                      "reinitialised": ["aux.weight", "aux.bias", "head.weight", "head.bias"]}
    after = model.state_dict()
    assert torch.equal(after["body.weight"], sd["body.weight"])
    assert torch.equal(after["aux.weight"], before["aux.weight"])


@pytest.mark.parametrize("file_model, beyond", [
    (Aux(classes=3, width=5), "'body.weight' (5, 3) in the file, (4, 3) in the model; "
                              "'body.bias' (5) in the file, (4) in the model; "
                              "'aux.weight' (3, 5) in the file, (3, 4) in the model"),
    (Aux(classes=3, body=2), "'body.weight' (4, 2) in the file, (4, 3) in the model"),
])
def test_a_tensor_beyond_the_heads_refuses_the_file(file_model, beyond):
    model = Aux()
    before = _sd(model)
    msg = _refusal(weights.load_pretrained, model, _sd(file_model), "model.weights w.pt")
    assert f": {beyond}; is it another" in msg, msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_body_tensor_as_long_as_the_class_count_is_not_a_head():
    model = Aux(classes=4, width=4)  # body.weight (4, 3): dim 0 is the class count
    msg = _refusal(weights.load_pretrained, model, _sd(Aux(classes=4, width=4, body=5)),
                   "model.weights w.pt")
    assert msg.endswith("or set model.weights_partial: true to load the 5 tensors that fit and "
                        "start the rest fresh"), msg
    assert "'body.weight' (4, 5) in the file, (4, 3) in the model" in msg


def test_a_missing_or_extra_tensor_beyond_the_head_is_listed():
    own = {"a.weight": torch.zeros(2, 2), "b.weight": torch.zeros(3), "head.weight":
           torch.zeros(3, 2), "head.bias": torch.zeros(3)}
    sd = {"a.weight": torch.zeros(2, 2), "c.weight": torch.zeros(1, 4), "head.weight":
          torch.zeros(3, 2), "fhead.weight": torch.zeros(9)}
    missing, unexpected, reshaped, beyond = weights._misfits(own, sd)
    assert (missing, unexpected, reshaped) == (["b.weight", "head.bias"],
                                               ["c.weight", "fhead.weight"], [])
    assert beyond == ["'b.weight' (3) is not in the file", "'c.weight' (1, 4) is not in the model"]


@pytest.mark.parametrize("n, fits, cut", [(4, 1, ""), (4, 0, ""), (5, 1, "; and 1 more"),
                                          (6, 1, "; and 3 more")])
def test_the_refusal_lists_eight_misfits_and_counts_the_rest(n, fits, cut):
    model = Layers(n, 2)
    sd = _sd(Layers(n, 3))
    if fits:
        sd[f"layers.{n - 1}.bias"] = torch.zeros(2)  # fits: 2n - 1 misfits
    msg = _refusal(weights.load_pretrained, model, sd, "model.weights w.pt")
    shown = "; ".join([f"'layers.{i}.{p}' {'(3, 3)' if p == 'weight' else '(3)'} in the file, "
                       f"{'(2, 2)' if p == 'weight' else '(2)'} in the model"
                       for i in range(n) for p in ("weight", "bias")
                       if not fits or (i, p) != (n - 1, "bias")][:8])
    assert msg == (
        f"model.weights w.pt does not fit model.name beyond its final layer ({2 * n - fits} "
        f"tensors; the model has {2 * n + 2}, the file {2 * n + 2}): {shown}{cut}; is it "
        f"another architecture or size? Fix model.name/model.kwargs or the file, or set "
        f"model.weights_partial: true to load the {1 + fits} tensors that fit and start the rest "
        f"fresh")


def test_nothing_that_fits_is_said_either_way():
    msg = _refusal(weights.load_pretrained, Tiny(), {"x.weight": torch.zeros(2)},
                   "model.weights w.pt")
    assert msg.endswith("the file, no tensor fits at all"), msg
    assert _refusal(weights.load_pretrained, Tiny(), {"x.weight": torch.zeros(2)},
                    "model.weights w.pt", True) == (
        "model.weights w.pt: no tensor of the file has the model's name and shape; is it "
        "another architecture?")


def test_a_partial_load_reports_what_was_used():
    model = Aux()
    sd = {**_sd(Aux(width=5)), "extra.weight": torch.zeros(2)}
    sd["head.bias"] = torch.full((3,), 7.0)
    report = weights.load_pretrained(model, sd, "model.weights w.pt", True)
    assert report == {"loaded": 2, "skipped": 5, "partial": True, "unused": ["extra.weight"],
                      "reinitialised": ["body.weight", "body.bias", "aux.weight",
                                        "head.weight"]}
    assert torch.equal(model.head.bias.detach(), torch.full((3,), 7.0))


# --------------------------------------------------------------------------- freezing

def test_nothing_to_freeze_freezes_nothing():
    model = Tiny()
    assert weights.freeze(model, None, "model.freeze") == 0
    assert weights.freeze(model, (), "model.freeze") == 0
    assert all(p.requires_grad for p in model.parameters())


def test_freezing_by_any_of_the_prefixes():
    model = Tiny()
    assert weights.freeze(model, ("backbone.0", "head.bias"), "model.freeze") == 3
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["backbone.0.weight", "backbone.0.bias", "head.bias"]


def test_a_freeze_that_matches_nothing_or_everything_says_so():
    assert _refusal(weights.freeze, Tiny(), ("backbone", "bakbone", "haed"),
                    "stages.1.freeze") == (
        "stages.1.freeze: no parameter name starts with 'bakbone', 'haed'; names look like "
        "backbone.0.weight, backbone.0.bias, backbone.1.weight, backbone.1.bias (top level: "
        "backbone, head)")
    assert _refusal(weights.freeze, Tiny(), ("backbone", "head"), "model.freeze") == (
        "model.freeze freezes every parameter ('backbone', 'head' cover all 6): nothing would "
        "train; leave the final layer (e.g. head.bias) out")


# --------------------------------------------------------------------------- init_from

def test_init_from_is_read_whole_and_checked(tmp_path):
    assert _refusal(weights.read_init_from, tmp_path / "final.pt", "stages.1.init_from") == (
        f"stages.1.init_from: {tmp_path / 'final.pt'} does not exist; run the earlier stage "
        f"first or fix the path")
    sd = _sd(Tiny())
    sd["head.bias"][0] = float("nan")
    torch.save({"model": sd}, tmp_path / "nan.pt")
    assert _refusal(weights.read_init_from, tmp_path / "nan.pt", "stages.1.init_from"
                    ).startswith(f"stages.1.init_from: {tmp_path / 'nan.pt'}: tensor 'head.bias'")


def test_the_launchers_init_from_check(tmp_path):
    torch.save({"model": _sd(Tiny(classes=5))}, tmp_path / "c5.pt")
    weights.check_init_from(None, tmp_path / "c5.pt", "stages.1.init_from")  # readable
    assert _refusal(weights.check_init_from, Tiny(), tmp_path / "c5.pt",
                    "stages.1.init_from") == (
        f"stages.1.init_from {tmp_path / 'c5.pt'} does not fit the model: 'head.weight' is "
        f"(5, 4) there, (3, 4) in the model")
    with pytest.raises(UserError, match="does not exist"):
        weights.check_init_from(None, tmp_path / "gone.pt", "stages.1.init_from")


def _cfg(stage_b: dict | None = None, **model):
    return from_dict({"stages": [{"name": "a"}, {"name": "b", **(stage_b or {})}],
                      "model": model})


def test_a_stage_initialised_from_the_previous_one(tmp_path):
    src = tmp_path / "final.pt"
    sd = _sd(Tiny())
    torch.save({"model": sd}, src)
    cfg, said = _cfg({"init_from": "previous", "freeze": ["head"]}, freeze=["backbone"]), []
    model = Tiny()
    report = weights.start_weights(cfg, cfg.stage("b"), model, src, said.append)
    assert report == {"from": str(src), "loaded": 9, "skipped": 0, "reinitialised": [],
                      "frozen": 2}
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    assert said == [f"initialised from {src}", "2 parameter tensors frozen (head)"]
    torch.save({"model": _sd(Tiny(classes=5))}, src)
    assert _refusal(weights.start_weights, cfg, cfg.stage("b"), Tiny(), src, said.append
                    ).startswith(f"stages.1.init_from {src} does not fit the model: 'head.")


def test_a_stage_from_pretrained_weights_reports_and_logs(tmp_path):
    src = tmp_path / "w.pt"
    torch.save(_sd(Tiny(classes=5)), src)
    cfg, said = _cfg(weights=str(src), freeze=["backbone.0"]), []
    model = Tiny()
    report = weights.start_weights(cfg, cfg.stage("b"), model, src, said.append)
    assert report == {"from": str(src), "loaded": 7, "skipped": 2,
                      "reinitialised": ["head.weight", "head.bias"], "frozen": 2}
    assert said == [f"model.weights {src}: 7 tensors loaded, 2 not used, 2 re-initialised "
                    f"(head.weight, head.bias)", "2 parameter tensors frozen (backbone.0)"]
    torch.save(_sd(Tiny(width=8)), src)
    cfg, said = _cfg(weights=str(src), weights_partial=True), []
    report = weights.start_weights(cfg, cfg.stage("b"), Tiny(), src, said.append)
    assert report["partial"] and report["frozen"] == 0 and report["loaded"] == 2
    assert said == [f"model.weights {src}: 2 tensors loaded, 7 not used, 7 re-initialised "
                    f"(backbone.0.weight, backbone.0.bias, backbone.1.weight, backbone.1.bias)"
                    f" (model.weights_partial)"]
    torch.save(_sd(Tiny()), src)
    said = []
    weights.start_weights(_cfg(weights=str(src)), cfg.stage("b"), Tiny(), src, said.append)
    assert said == [f"model.weights {src}: 9 tensors loaded, 0 not used, 0 re-initialised"]


def test_a_stage_without_starting_weights(tmp_path):
    said = []
    cfg = _cfg({"freeze": ["backbone.1"]}, freeze=["head"])
    model = Tiny()
    assert weights.start_weights(cfg, cfg.stage("b"), model, None, said.append) == {
        "frozen": 2}
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == [
        "backbone.1.weight", "backbone.1.bias"]
    assert said == ["2 parameter tensors frozen (backbone.1)"]
    assert weights.start_weights(cfg, cfg.stage("a"), Tiny(), None, said.append) == {
        "frozen": 2}  # model.freeze: head
    plain = _cfg()
    assert weights.start_weights(plain, plain.stage("b"), Tiny(), None, said.append) is None
    assert "model.freeze: no parameter" in _refusal(
        weights.start_weights, _cfg(freeze=["nope"]), cfg.stage("a"), Tiny(), None, print)
    assert "stages.1.freeze: no parameter" in _refusal(
        weights.start_weights, _cfg({"freeze": ["nope"]}), _cfg({"freeze": ["nope"]}).stage(
            "b"), Tiny(), None, print)
    # init_from without a file (the first stage of a fresh run): nothing loaded
    cfg = _cfg({"init_from": "previous"})
    assert weights.start_weights(cfg, cfg.stage("b"), Tiny(), None, said.append) is None


def test_a_pretrained_file_for_a_stage_without_init_from_uses_the_head_rule(tmp_path):
    src = tmp_path / "w.pt"
    torch.save(_sd(Tiny(width=8)), src)
    cfg = _cfg(weights=str(src))
    assert _refusal(weights.start_weights, cfg, cfg.stage("b"), Tiny(), src, print).startswith(
        f"model.weights {src} does not fit model.name beyond its final layer")




# --------------------------------------------------------------------------- modelcheck

BLOCKY = '''
from torch import nn


def build(num_classes, in_channels=3):
    assert num_classes == 3, "made for 3 classes"
    return nn.Sequential(nn.Sequential(nn.Conv2d(in_channels, 4, 3), nn.ReLU()),
                         nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()), nn.Flatten(),
                         nn.Linear(64, num_classes))
'''
FSDP = {"name": "a", "strategy": "fsdp"}
CHANNELS = '''
import torch
from torch import nn
from torch.utils.data import Dataset


def wants(n):
    def build(num_classes=None, in_channels=None):
        if in_channels != n:
            raise ValueError(f"built for {n} channels, given {in_channels}")
        return nn.Sequential(nn.Sequential(nn.Linear(5, 5)), nn.Sequential(nn.Linear(5, 2)))
    return build


one, three = wants(1), wants(3)


class Vectors(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((5,), float(i)), i % 3


def vectors(split):
    return Vectors()
'''


def _mc(tmp_path, stages=None, data=None, **model):
    return from_dict({"results_dir": str(tmp_path / "results"), "run": "t",
                      "data": {"train_size": 64, "val_size": 16, "test_size": 16,
                               "image_size": 8, **(data or {})},
                      "stages": stages or [{"name": "a"}], "model": model})


def test_only_a_config_that_shards_recomputes_or_sets_kwargs_is_built(tmp_path):
    from ddpflow.engine.modelcheck import needs_model

    assert not needs_model(_mc(tmp_path))
    assert needs_model(_mc(tmp_path, kwargs={"width": 8}))
    assert needs_model(_mc(tmp_path, [{"name": "a"}, {**FSDP, "name": "b"}]))
    assert needs_model(_mc(tmp_path, [{"name": "a"}, {"name": "b",
                                                      "activation_checkpointing": True}]))
    assert not needs_model(_mc(tmp_path, [{"name": "a", "strategy": "dp"}]))


@pytest.mark.parametrize("data, shape", [
    ({"num_classes": 7}, (7, 3, True)), ({"num_classes": 7, "grayscale": True}, (7, 1, True)),
    ({"source": "cifar100", "path": "x"}, (100, 3, True)),
    ({"source": "mnist", "path": "x"}, (10, 1, True)),
    ({"source": "cifar10", "path": "x", "grayscale": True}, (10, 1, True)),
    ({"source": "imagefolder", "path": "x"}, (2, 3, False)),
    ({"source": "imagefolder", "path": "x", "grayscale": True}, (2, 1, False)),
])
def test_the_data_shape_before_anything_is_prepared(tmp_path, data, shape):
    from ddpflow.engine.modelcheck import data_shape

    assert data_shape(_mc(tmp_path, data=data)) == shape


def test_the_data_shape_of_a_prepared_folder_is_its_meta(tmp_path):
    from ddpflow.data.prepare import prepare
    from ddpflow.engine.modelcheck import data_shape

    prepare(_mc(tmp_path, data={"num_classes": 4, "grayscale": True}))
    # the same folder read by a config that would guess otherwise: the meta decides
    assert data_shape(_mc(tmp_path, data={"num_classes": 9})) == (4, 1, True)
    # a damaged meta.json (prepare rebuilds it): the config's own shape, no refusal
    cfg = _mc(tmp_path, data={"num_classes": 9})
    (cfg.data_dir / "meta.json").write_text("{not json")
    assert data_shape(cfg) == (9, 3, True)


def _code(tmp_path):
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "blocky.py").write_text(BLOCKY)
    return str(code)


def test_validation_builds_the_users_model_and_finds_its_blocks(tmp_path):
    from ddpflow.engine.modelcheck import check_model

    code = _code(tmp_path)
    ok = _mc(tmp_path, [FSDP], {"num_classes": 3}, name="blocky:build", code_dir=code)
    check_model(ok)  # its code dir on the path, 3 classes, blocks found
    wrong = _mc(tmp_path, [{"name": "a"}, {**FSDP, "name": "b"}], {"num_classes": 3},
                name="blocky:build", code_dir=code, shard_blocks=["Blok"])
    assert _refusal(check_model, wrong).startswith(
        "model.shard_blocks: 'Blok' is not the class of any module of the model")
    known = _mc(tmp_path, [FSDP], {"num_classes": 5}, name="blocky:build", code_dir=code)
    assert "made for 3 classes" in _refusal(check_model, known)
    # a guessed class count (an image folder not prepared): launch decides, not validate
    guess = _mc(tmp_path, [FSDP], {"source": "imagefolder", "path": "x"},
                name="blocky:build", code_dir=code)
    check_model(guess)
    bad = _mc(tmp_path, [FSDP], {"source": "imagefolder", "path": "x"}, kwargs={"bogus": 1})
    assert _refusal(check_model, bad).startswith("model.kwargs.bogus: smallcnn takes no")
    # not needed: never built (a model that cannot be built passes)
    check_model(_mc(tmp_path, data={"num_classes": 5}, name="blocky:build", code_dir=code))


def test_trials_that_share_a_model_are_built_once(tmp_path):
    from ddpflow.engine.modelcheck import check_model

    seen: set = set()
    bad = _mc(tmp_path, [FSDP], kwargs={"bogus": 1})
    assert "model.kwargs.bogus" in _refusal(check_model, bad, seen)
    check_model(_mc(tmp_path, [{**FSDP, "lr": 0.5}], kwargs={"bogus": 1}), seen)  # seen
    assert "model.kwargs.bogus" in _refusal(check_model, bad)  # without `seen`: built
    assert len(seen) == 1


def test_validation_leaves_torch_dynamo_unimported(tmp_path):
    """A torchvision model is built without importing torch._dynamo (seconds of validate)."""
    import subprocess

    code = ("import sys\n"
            "from ddpflow.config import from_dict\n"
            "from ddpflow.engine.modelcheck import check_model\n"
            "check_model(from_dict({'model': {'name': 'resnet18'}, "
            "'stages': [{'name': 'a', 'strategy': 'fsdp'}]}))\n"
            "print(getattr(sys.modules.get('torch._dynamo'), '__file__', None))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert out.stdout.strip() == "None", out.stdout


def test_the_model_is_built_for_the_datas_channels_or_three(tmp_path):
    from ddpflow.data.prepare import prepare
    from ddpflow.engine.modelcheck import check_model, data_shape

    (tmp_path / "chan.py").write_text(CHANNELS)
    code = str(tmp_path)
    gray = _mc(tmp_path, [FSDP], {"grayscale": True}, name="chan:one", code_dir=code)
    check_model(gray)
    assert "built for 3 channels, given 1" in _refusal(check_model, _mc(
        tmp_path, [FSDP], {"grayscale": True}, name="chan:three", code_dir=code))
    # a user dataset of vectors: no image channels known, the model gets the default 3
    vec = _mc(tmp_path / "v", [FSDP], {"source": "python", "factory": "chan:vectors",
                                       "code_dir": code}, name="chan:three", code_dir=code)
    prepare(vec)
    assert data_shape(vec) == (None, None, True)
    check_model(vec)


# --------------------------------------------------------------------------- efficiency

@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 NVL", "bf16", 835e12), ("NVIDIA H100 80GB HBM3", "fp16", 989e12),
    ("NVIDIA H100 PCIe", "fp32", 378e12), ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA RTX A1000", "bf16", None), ("NVIDIA L40S", "fp32", 183e12),
    ("NVIDIA L4", "bf16", 121e12), ("Tesla V100-SXM2-16GB", "fp32", 15.7e12),
    ("NVIDIA GH200 480GB", "bf16", 989e12), ("NVIDIA B200", "bf16", None)])
def test_a_gpus_peak_is_its_own_never_a_neighbours(name, precision, peak):
    from ddpflow.engine.efficiency import peak_for_name

    assert peak_for_name(name, precision) == peak


def test_a_cpu_has_no_peak_and_no_gpu_samples():
    from ddpflow.engine.efficiency import GpuSampler, peak_flops

    assert peak_flops(torch.device("cpu"), "bf16") is None
    sampler = GpuSampler([torch.device("cpu")])
    assert sampler.interval() == (None, None) and sampler.handles == []
    sampler.close()
    assert GpuSampler([]).interval() == (None, None)


def test_flops_of_a_step_are_counted_forward_and_backward(capsys):
    from ddpflow.engine.efficiency import FlopCount

    layer = nn.Linear(8, 4, bias=False)
    with FlopCount() as counter:
        layer(torch.rand(5, 8)).sum().backward()
    assert capsys.readouterr().out == ""  # counted quietly: no table in the training log
    assert counter.total == 2 * (2 * 5 * 8 * 4)  # forward, and the weight gradient
    assert FlopCount().total is None
    with pytest.raises(ZeroDivisionError):  # an error inside is the caller's, as it was
        with FlopCount():
            _ = 1 / 0
    with FlopCount() as second:  # the first counter is off: a count of its own
        layer(torch.rand(1, 8))
    assert second.total == 2 * 8 * 4 and counter.total == 640


def test_a_batch_is_cut_to_its_first_samples_whatever_holds_it():
    from ddpflow.engine.efficiency import _head

    x = torch.arange(10)
    got = _head({"a": x, "b": (x, [x]), "n": 3, "s": torch.tensor(2.0)}, 4)
    assert torch.equal(got["a"], x[:4]) and isinstance(got["b"], tuple)
    assert torch.equal(got["b"][1][0], x[:4]) and isinstance(got["b"][1], list)
    assert got["n"] == 3 and float(got["s"]) == 2.0


def test_a_measuring_pass_leaves_no_trace():
    from ddpflow.engine.efficiency import untouched

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    stats = [b.clone() for b in model.buffers()]
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    with untouched(model):
        model(torch.randn(8, 3) * 5 + 2).sum().backward()
        torch.rand(5)
    assert torch.equal(torch.rand(2), expected)  # the random stream as it was
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), stats))
    assert all(p.grad is None for p in model.parameters())


def test_the_flops_of_one_replica_are_scaled_to_the_batch():
    from ddpflow.engine.efficiency import FlopCount, replica_flops, replicas

    layer = nn.Linear(8, 4, bias=False)
    seen = []

    def step(net, part):
        seen.append(len(part))
        net(part).sum().backward()

    flops = replica_flops(layer, torch.rand(10, 8), 10, 3, step)
    assert seen == [4]  # ceil(10 / 3) samples, on the plain module
    with FlopCount() as one:
        step(layer, torch.rand(4, 8))
    assert flops == one.total * 10 // 4 and layer.weight.grad is not None  # the second step
    assert type(flops) is int  # a count, as summary.json records it
    assert replicas(layer) == 1 and replicas(nn.DataParallel(layer)) == 1  # no GPUs here


def test_the_first_steps_count_flops_then_activations_then_train():
    from ddpflow.engine.efficiency import FirstSteps, FlopCount

    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    calls = []

    def micro(net, batch, check):
        calls.append((net, check))
        loss = net(batch).sum()
        loss.backward()
        return loss

    compiled = nn.Sequential(model)  # stands for the compiled model the step runs
    hook = FirstSteps(model, compiled, [], 5, micro)
    batch = torch.rand(5, 8)
    assert torch.equal(hook(batch), model(batch).sum())  # each call returns its loss
    with FlopCount() as want:
        micro(model, batch, False)
    assert hook.flops == want.total and hook.activations is None
    assert torch.equal(hook(batch), model(batch).sum())
    assert hook.activations["activations"] > 0
    hook(batch)
    assert calls[0] == (model, True) and calls[2] == (compiled, False)
    assert calls[3] == (compiled, False) and len(calls) == 4
    hook.recount()
    assert hook.flops is None
    hook(batch)
    assert hook.flops == want.total and calls[-1] == (model, True)


def test_validation_finds_a_model_in_the_data_code_dir(tmp_path):
    """model.name's module may sit in data.code_dir (model.code_dir unset), as for launch."""
    from ddpflow.engine.modelcheck import check_model

    (tmp_path / "modelindatadir.py").write_text(BLOCKY)
    check_model(_mc(tmp_path, [FSDP], {"num_classes": 3, "code_dir": str(tmp_path)},
                    name="modelindatadir:build"))

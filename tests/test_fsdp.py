"""Beyond one rank's memory and back onto fewer ranks: strategy fsdp (FSDP2 with 2 gloo ranks
on CPU), activation checkpointing, sharded checkpoints, and a checkpoint of N ranks resumed on
M with the same global batch (DDP and FSDP)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from conftest import ddpflow, tiny_config, write_config
from fixtures import image_tree

FSDP_STAGE = {"name": "s1", "epochs": 2, "batch_size": 32, "lr": 0.05, "strategy": "fsdp",
              "activation_checkpointing": True}


def stage_dir(root: Path) -> Path:
    return root / "results" / "t" / "stages" / "s1"


def final(root: Path) -> dict:
    return torch.load(stage_dir(root) / "final.pt", weights_only=True)["model"]


def summary(root: Path) -> dict:
    return json.loads((stage_dir(root) / "summary.json").read_text())


def seen(trace: Path) -> dict[int, list[int]]:
    """Epoch -> every sample index trained on, all ranks and runs (DDPFLOW_SAMPLE_TRACE)."""
    out: dict[int, list[int]] = defaultdict(list)
    for f in trace.glob("rank*.txt"):
        for line in f.read_text().splitlines():
            epoch, _step, *idx = line.split()
            out[int(epoch)] += map(int, idx)
    return dict(out)


def run(root: Path, *extra, ranks: int | None = None, trace: Path | None = None):
    """`ddpflow launch` of stage s1 in `root` (its config set to `ranks` ranks first)."""
    path = root / "config.yaml"
    if ranks is not None:
        cfg = yaml.safe_load(path.read_text())
        cfg["hardware"]["nproc_per_node"] = ranks
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {"DDPFLOW_SAMPLE_TRACE": str(trace)} if trace else None
    if trace:
        trace.mkdir(exist_ok=True)
    return ddpflow("launch", "--config", path, "--stage", "s1", *extra, env=env)


def setup_run(root: Path, stage: dict, ranks: int = 2, **top) -> Path:
    root.mkdir(parents=True)
    cfg = tiny_config(root, stages=[stage], **top)
    cfg["hardware"]["nproc_per_node"] = ranks
    p = write_config(root, cfg)
    ddpflow("prepare", "--config", p, check=True)
    return p


MIB = 2**20


def kept_for_backward(model: nn.Module, x: torch.Tensor, blocks: list,
                      loss=lambda out: out.sum()) -> tuple[int, int]:
    """(bytes kept for the backward with `blocks` checkpointed, without), counted on the
    plain model, apart from the product's meter: every storage autograd saves (parameters
    left out), once; with checkpointing, what the model saves outside the blocks and the
    blocks' inputs instead of what they save."""
    inside, outer, inner, inputs = [0], {}, {}, {}

    def key(t):
        return t.untyped_storage().data_ptr()

    def pack(t):
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):
            (inner if inside[0] else outer)[key(t)] = t.untyped_storage().nbytes()
        return t

    def enter(_m, args):
        inside[0] += 1
        inputs.update((key(a), a.untyped_storage().nbytes()) for a in args)

    def leave(*_):
        inside[0] -= 1
    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter),
                                         b.register_forward_hook(leave))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(model(x))
    for h in hooks:
        h.remove()
    return sum({**outer, **inputs}.values()), sum({**outer, **inner}.values())


def test_activations_are_what_autograd_keeps_each_storage_once():
    """The meter on a model whose saved tensors are counted by hand (batch 4, fp32: 16 bytes
    a feature), its three blocks checkpointed: it keeps x (8: the first layer's input), the
    ReLU's output (32: also the first block's input), the first block's output (32: the
    second's input), the second's (32: the next layer's) and the last block's input (16);
    without checkpointing, x, the same 32 + 32 + 32, the 64 features inside the second
    block and the last block's ReLU output (16), but not its input (its ReLU keeps its
    output). What two of them keep (a layer and a block, a block and the next) is the same
    memory: counted once."""
    from ddpflow.engine import sharding
    from ddpflow.engine.memory import activation_meter

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(),
                             nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                             nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32),
                                           nn.ReLU(inplace=True)),
                             nn.Linear(32, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 4)))
    x = torch.randn(4, 8)
    plain, model = net(), net()
    blocks = [model[2], model[3], model[5]]
    assert kept_for_backward(plain, x, [plain[2], plain[3], plain[5]]) == (16 * 120, 16 * 184)
    sharding.checkpoint_blocks(blocks)
    with activation_meter(blocks) as m:
        loss = model(x).sum()
    loss.backward()
    assert m == {"activations": 16 * 120, "without_checkpointing": 16 * 184}
    loss = plain(x).sum()
    loss.backward()  # the measure changed nothing the training computes
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(),
                                                           model.parameters()))
    # the model the FSDP stage trains: as counted apart, BatchNorm and max-pooling included
    from ddpflow.seams.models import SmallCNN

    cnn = SmallCNN(10)
    x = torch.randn(8, 3, 16, 16)
    blocks = [b for b in cnn.features if isinstance(b, nn.Sequential)]
    want = kept_for_backward(cnn, x, blocks)
    sharding.checkpoint_blocks(blocks)
    with activation_meter(blocks) as m:
        cnn(x).sum().backward()
    assert (m["activations"], m["without_checkpointing"]) == want


@pytest.mark.parametrize("optimizer,states", [("adamw", 2), ("sgd", 1)])
def test_optimizer_memory_counts_each_state_of_each_parameter(optimizer, states):
    """AdamW keeps two moments per parameter (its step counter is a scalar), SGD with
    momentum one buffer: counted here from the parameters, after a real step."""
    from types import SimpleNamespace

    from ddpflow.engine.memory import memory_record
    from ddpflow.engine.runtime import build_optimizer

    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 10))
    st = SimpleNamespace(optimizer=optimizer, weight_decay=0.01, momentum=0.9, nesterov=False,
                         norm_weight_decay=None)
    opt = build_optimizer(model, st, 0.01, torch.device("cpu"))
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    whole = sum(p.numel() * 4 for p in model.parameters())
    m = memory_record(model, opt, None, torch.device("cpu"))
    assert m["params_mib"] == m["grads_mib"] == round(whole / MIB, 2)
    assert m["optimizer_mib"] == round(states * whole / MIB, 2)


def same_weights(a: dict, b: dict, exact: bool) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        elif "running" not in k and "num_batches" not in k:
            # another number of ranks sums the gradients in another order; BatchNorm's
            # running statistics are rank 0's, which trains other micro-batches then
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An FSDP stage with activation checkpointing, uninterrupted on 2 ranks."""
    root = tmp_path_factory.mktemp("fsdp") / "straight"
    setup_run(root, FSDP_STAGE)
    proc = run(root, trace=root / "trace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, proc.stderr


@pytest.mark.slow
def test_fsdp_with_activation_checkpointing_trains_and_reports_its_memory(straight):
    root, err = straight
    assert "fsdp: 3 Sequential blocks + root sharded" in err
    assert "activation checkpointing: 3 Sequential blocks recomputed" in err
    s = summary(root)
    assert s["strategy"] == "fsdp" and s["wrapper"] == "FSDP" and s["checkpointed_blocks"] == 3
    assert s["final_val_acc"] > 0.3  # it learns (10 classes)
    mem = s["memory_per_rank"]
    assert len(mem) == 2 and all(m["peak_mib"] > 0 for m in mem)
    # each rank holds its own rows of every parameter (FSDP2 shards dim 0 as torch.chunk
    # does), their gradients and SGD's one momentum buffer: counted here from the model
    from ddpflow.seams.models import SmallCNN

    model = SmallCNN(10)
    assert s["params"] == sum(p.numel() for p in model.parameters())
    for rank, m in enumerate(mem):
        own = sum(torch.chunk(torch.empty(p.shape), 2)[rank].numel() * 4
                  for p in model.parameters())
        assert m["params_mib"] == m["grads_mib"] == m["optimizer_mib"] == round(own / MIB, 2)
    # one micro-batch's activations (32 images of 3 x 16 x 16, the loss's too), counted
    # here on the plain model: checkpointing keeps the blocks' inputs instead of everything
    # they saved
    blocks = [b for b in model.features if isinstance(b, nn.Sequential)]
    kept, without = kept_for_backward(
        model, torch.randn(32, 3, 16, 16), blocks,
        loss=lambda out: nn.functional.cross_entropy(out, torch.randint(10, (32,))))
    for m in mem:
        assert m["activations_mib"] == round(kept / MIB, 2)
        assert m["activations_without_checkpointing_mib"] == round(without / MIB, 2)
        assert m["activations_mib"] < 0.7 * m["activations_without_checkpointing_mib"]
    # sharded checkpoints: folders, every file listed in the checksum file written last
    ckpts = sorted(p.name for p in (stage_dir(root) / "checkpoints").iterdir())
    assert ckpts[-2:] == ["ckpt-000000032.dcp", "ckpt-000000032.dcp.sha256"]
    listed = (stage_dir(root) / "checkpoints/ckpt-000000032.dcp.sha256").read_text()
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"):
        assert f"  {name}\n" in listed
    # final.pt holds the whole model, gathered once
    full = final(root)
    assert full["features.0.0.weight"].shape == (32, 3, 3, 3) and not any(
        hasattr(t, "placements") for t in full.values())
    assert len(s["rank_weight_sha256"]) == 1 and s["weights_in_sync"]
    # the report shows the largest rank's memory by kind
    ddpflow("collect", "--config", root / "config.yaml", check=True)
    html = (root / "results/t/summary/report.html").read_text()
    row = html.split('<table id="memory">')[1].split("</table>")[0]
    assert "<td>s1</td><td>fsdp</td><td>2</td>" in row
    assert f"<td>{max(m['peak_mib'] for m in mem):,.1f}</td>" in row


def test_tune_counts_what_a_rank_holds_under_fsdp():
    """tune's memory phase adds to the plain model's step (weights, gradients, one optimizer
    state) what the strategy changes: DDP's gradient buckets; under FSDP a rank's own rows of
    the three instead of all of them (FSDP2 shards dim 0 as torch.chunk does: counted here
    from the model), and the largest block's weights and gradients, gathered."""
    from types import SimpleNamespace

    from ddpflow.engine.memory import model_extra
    from ddpflow.seams.models import SmallCNN

    model = SmallCNN(10)
    blocks = [b for b in model.features if isinstance(b, nn.Sequential)]
    whole = sum(p.numel() * 4 for p in model.parameters())
    two = SimpleNamespace(world=2, backend="gloo")
    assert model_extra(model, blocks, two, "ddp") == whole
    held = max(sum(torch.chunk(torch.empty(p.shape), 2)[rank].numel() * 4
                   for p in model.parameters()) for rank in (0, 1))
    gathered = max(sum(p.numel() * 4 for p in b.parameters()) for b in blocks)
    assert model_extra(model, blocks, two, "fsdp") == 3 * held - 3 * whole + 2 * gathered


@pytest.mark.slow
def test_tune_measures_an_fsdp_stage_as_it_trains(tmp_path):
    """tune's trials wrap the model as the stage trains it (checkpointed blocks, FSDP): no
    channels_last (FSDP2 shards contiguous parameters only), no fp16."""
    root = tmp_path / "tune"
    p = setup_run(root, {**FSDP_STAGE, "batch_size": "auto", "precision": "auto",
                         "channels_last": "auto"},
                  tune={"max_batch": 64, "steps": 2, "budget_s": 60})
    proc = ddpflow("tune", "--config", p)
    assert proc.returncode == 0, proc.stderr[-3000:]
    t = json.loads((root / "results/t/tune.json").read_text())
    assert t["settings"]["strategy"] == "fsdp" and t["settings"]["activation_checkpointing"]
    assert {r["precision"] for r in t["precision"]} == {"fp32", "bf16"}
    assert not any(r["channels_last"] for r in t["precision"]) and not t["choice"][
        "channels_last"]


@pytest.mark.slow
def test_fsdp_halted_resumes_on_the_same_fewer_and_more_ranks(straight, tmp_path):
    """Halted at step 12 of 32 (16 steps an epoch): resumed on 2 ranks it is the
    uninterrupted run bit for bit; on 1 rank (2 accumulation steps, the same global batch
    of 64) it trains every epoch on the same samples, none twice, to the same weights. A
    1-rank run with 2 accumulation steps, halted, resumes on 2 ranks the same way."""
    ref, _ = straight
    want = seen(ref / "trace")
    halted = tmp_path / "two"
    setup_run(halted, FSDP_STAGE)
    proc = run(halted, "--halt-after-steps", "12", trace=halted / "trace")
    assert proc.returncode == 75, proc.stderr[-3000:]
    fewer = tmp_path / "one"
    shutil.copytree(halted, fewer)  # the same checkpoint, requeued onto 1 rank
    cfg = yaml.safe_load((fewer / "config.yaml").read_text())
    cfg["results_dir"] = str(fewer / "results")
    (fewer / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    proc = run(halted, trace=halted / "trace")
    assert proc.returncode == 0 and "resumed from ckpt-000000012.dcp" in proc.stderr
    same_weights(final(ref), final(halted), exact=True)

    proc = run(fewer, ranks=1, trace=fewer / "trace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("on 1 rank(s) it stays 64: 32/rank x 1 x 2 accumulation" in proc.stderr
            and "resumed from ckpt-000000012.dcp" in proc.stderr)
    got = seen(fewer / "trace")
    for epoch in (0, 1):
        assert len(got[epoch]) == len(set(got[epoch])) == 1024  # none lost, none twice
        assert sorted(got[epoch]) == sorted(want[epoch])
    same_weights(final(ref), final(fewer), exact=False)
    assert summary(fewer)["world_size"] == 1 and summary(fewer)["grad_accum_steps"] == 2
    assert summary(fewer)["global_batch"] == 64

    more = tmp_path / "more"
    setup_run(more, {**FSDP_STAGE, "grad_accum_steps": 2}, ranks=1)
    assert run(more, "--halt-after-steps", "12", trace=more / "trace").returncode == 75
    proc = run(more, ranks=2, trace=more / "trace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 2 rank(s) it stays 64: 32/rank x 2 x 1 accumulation" in proc.stderr
    got = seen(more / "trace")
    assert all(sorted(got[e]) == sorted(want[e]) for e in (0, 1))
    same_weights(final(ref), final(more), exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("fault,left", [
    # rank 0 killed between the folder's rename and its sidecar: the folder is all there
    # but its write did not finish; resuming it would trust what nothing verified
    ("after-rename", "skipping checkpoint ckpt-000000016.dcp: no checksum file"),
    # every rank killed with half of its shard file on disk: the temp folder is left
    ("mid-shard", "removing unfinished checkpoint write .ckpt-000000016.dcp.tmp"),
])
def test_a_rank_killed_in_a_sharded_write_resumes_from_the_good_one(straight, tmp_path, fault,
                                                                     left):
    """A real SIGKILL inside the step-16 checkpoint's write (shardedckpt.py's test hook
    DDPFLOW_FAULT, in torchrun's first attempt only): torchrun restarts the group, which
    resumes from step 8, the newest checkpoint that verifies, to the uninterrupted run's
    weights bit for bit."""
    ref, _ = straight
    root = tmp_path / fault
    setup_run(root, FSDP_STAGE)
    proc = ddpflow("launch", "--config", root / "config.yaml", "--stage", "s1",
                   env={"DDPFLOW_FAULT": f"{fault}:16"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr, proc.stderr[-3000:]  # the kill really happened
    resumed = re.findall(r"resumed from (ckpt-\d+\.dcp)", proc.stderr)
    assert resumed == ["ckpt-000000008.dcp"], proc.stderr[-3000:]
    assert left in proc.stderr, proc.stderr[-3000:]
    same_weights(final(ref), final(root), exact=True)
    ckdir = stage_dir(root) / "checkpoints"
    assert not list(ckdir.glob(".ckpt-*"))  # nothing half-written is left behind
    from ddpflow.engine import checkpoint

    assert all(checkpoint.verify_folder(p) is None for _, p in checkpoint.list_checkpoints(ckdir))


@pytest.mark.slow
def test_ddp_resumes_on_fewer_ranks_and_says_when_it_cannot(tmp_path):
    """DDP's checkpoint (the whole state) on another number of ranks: the same samples and
    weights as the uninterrupted run (which ran without activation checkpointing); a number
    of ranks that cannot make the global batch is one message, and nothing of the
    checkpoints is lost."""
    stage = {"name": "s1", "epochs": 2, "batch_size": 16, "lr": 0.05}
    ref, halted = tmp_path / "ref", tmp_path / "halted"
    setup_run(ref, stage, model={"name": "mlp"})
    # activation checkpointing under DDP too (named classes): it changes no result
    setup_run(halted, {**stage, "activation_checkpointing": ["Linear"]}, model={"name": "mlp"})
    assert run(ref, trace=ref / "trace").returncode == 0
    assert run(halted, "--halt-after-steps", "20", trace=halted / "trace").returncode == 75
    bad = run(halted, ranks=3)  # a global batch of 32 is not 3 ranks' share
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert ("stages.0: ckpt-000000020.pt (step 20) was trained on 2 rank(s) with a global "
            "batch of 32 (16/rank x 2 x 1 accumulation), which 3 ranks cannot share evenly"
            in bad.stderr)
    assert (stage_dir(halted) / "checkpoints/ckpt-000000020.pt").is_file()
    proc = run(halted, ranks=1, trace=halted / "trace")
    assert proc.returncode == 0 and "resumed from ckpt-000000020.pt" in proc.stderr
    assert "activation checkpointing: 2 Linear blocks recomputed" in proc.stderr
    want, got = seen(ref / "trace"), seen(halted / "trace")
    assert all(sorted(got[e]) == sorted(want[e]) and len(set(got[e])) == len(got[e])
               for e in (0, 1))
    same_weights(final(ref), final(halted), exact=False)
    # DDP holds the whole model on each rank: twice FSDP's share of it
    m = summary(ref)["memory_per_rank"][0]
    assert m["params_mib"] == pytest.approx(summary(ref)["params"] * 4 / 2**20, rel=0.01)


@pytest.mark.slow
def test_evaluate_export_and_predict_read_an_fsdp_stage(straight, tmp_path):
    root, _ = straight
    cfg = root / "config.yaml"
    proc = ddpflow("evaluate", "--config", cfg, check=True)
    m = json.loads((root / "results/t/evaluate/s1/test-final/metrics.json").read_text())
    assert m["acc"] == pytest.approx(summary(root)["test_acc"]) and m["samples"] == 256
    ddpflow("export", "--config", cfg, check=True)
    photos = image_tree(tmp_path / "photos", per_class=2, size=(20, 20))
    proc = ddpflow("predict", "--bundle", root / "results/t/export", "--out",
                   tmp_path / "pred.csv", photos)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((tmp_path / "pred.csv").read_text().splitlines()) == 1 + 6


def test_a_shard_blocks_mistake_is_one_message(tmp_path):
    from ddpflow.config import from_dict
    from ddpflow.core.errors import UserError
    from ddpflow.engine.build import model_blocks
    from ddpflow.seams.models import SmallCNN

    def blocks(model, **over):
        raw = tiny_config(tmp_path, stages=[{**FSDP_STAGE, **over.pop("stage", {})}])
        raw["model"] = over
        cfg = from_dict(raw)
        return model_blocks(cfg, cfg.stages[0], model)

    with pytest.raises(UserError) as e:
        blocks(SmallCNN(10), shard_blocks=["Blok"])
    assert str(e.value) == (
        "model.shard_blocks: 'Blok' is not the class of any module of the model; model "
        "smallcnn has repeated blocks Sequential (3); name one of those classes (or null: "
        "found in the model)")
    # what is not a block: a layer without parameters, the model itself; another case
    for name, why in (("ReLU", "has no parameters: it is a layer, not a block"),
                      ("SmallCNN", "is the model itself, not one of its blocks"),
                      ("sequential", "is not the class of any module of the model (did you "
                                     "mean 'Sequential'?)")):
        with pytest.raises(UserError, match=re.escape(f"'{name}' {why}; model smallcnn")):
            blocks(SmallCNN(10), stage={"activation_checkpointing": [name]})
    # the class found names the same blocks when named (not the Sequential around them)
    named, _ = blocks(SmallCNN(10), stage={"activation_checkpointing": ["Sequential"]})
    found, _ = blocks(SmallCNN(10), stage={"activation_checkpointing": True})
    assert [type(b).__name__ for b in named] == [type(b).__name__ for b in found] == [
        "Sequential"] * 3 and all(len(b) == 3 for b in named)  # conv, norm, relu each
    with pytest.raises(UserError, match=r"^stages\.0\.strategy fsdp: model smallcnn has no "
                                        r"repeated blocks \(6 parameters\) to shard"):
        blocks(nn.Linear(3, 2, bias=False).requires_grad_())
    with pytest.raises(UserError, match=r"stages\.0\.activation_checkpointing: 'Blok' is not.*"
                                        r"\(or true: found in the model\)"):
        blocks(SmallCNN(10), stage={"activation_checkpointing": ["Blok"]})
    ac, shard = blocks(SmallCNN(10), stage={"activation_checkpointing": ["Conv2d"]})
    assert [type(b).__name__ for b in ac] == ["Conv2d"] * 3 and len(shard) == 3
    # tied weights across blocks (one Linear used by two blocks): FSDP cannot shard them
    shared = nn.Linear(4, 4)
    tied = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.ReLU()))
    with pytest.raises(UserError, match=r"uses parameter '1\.0\.weight' in two of its blocks"):
        blocks(tied)
    untied = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4)))
    assert len(blocks(untied)[1]) == 2
    # through the command: the same one message before any rank starts, exit 2
    raw = tiny_config(tmp_path, stages=[FSDP_STAGE], model={"shard_blocks": ["Blok"]})
    p = write_config(tmp_path, raw)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"ddpflow: error: {e.value}"
    assert "[s1]" not in proc.stderr  # no rank was started (they say [s1] ...)


@pytest.mark.parametrize("name,cls,count", [("resnet18", "BasicBlock", 8),
                                            ("vit_b_16", "EncoderBlock", 12),
                                            ("convnext_tiny", "CNBlock", 18),
                                            ("mlp", "Linear", 2)])
def test_blocks_are_found_in_models_of_every_kind(name, cls, count):
    """The repeated blocks (not the stage containers around them, nor single layers)."""
    from types import SimpleNamespace

    from ddpflow.engine.sharding import find_blocks
    from ddpflow.seams.models import build_model

    with torch.device("meta"):
        model = build_model(SimpleNamespace(name=name, kwargs={}, weights=None, code_dir=None),
                            10, 3)
    found = find_blocks(model, None, name)
    assert {type(b).__name__ for b in found} == {cls} and len(found) == count


@pytest.mark.parametrize("over,message", [
    ({"ema": {"decay": 0.9}}, r"stages\.0\.ema: an EMA of the weights is not kept under "
                              r"strategy fsdp"),
    ({"compile": True}, r"stages\.0\.compile: torch\.compile is not offered with strategy fsdp"),
    ({"precision": "fp16"}, r"stages\.0\.precision: fp16 does not go with strategy fsdp"),
    ({"strategy": "ddp", "reshard_after_forward": False},
     r"stages\.0\.reshard_after_forward: false is a setting of strategy fsdp"),
    ({"strategy": "dp", "activation_checkpointing": "yes"}, r"activation_checkpointing"),
])
def test_what_fsdp_does_not_go_with_is_one_message(tmp_path, over, message):
    from ddpflow.config import from_dict
    from ddpflow.core.errors import UserError

    with pytest.raises(UserError, match=message):
        from_dict(tiny_config(tmp_path, stages=[{**FSDP_STAGE, **over}]))


def test_a_requeue_keeps_the_global_batch_or_says_why_not():
    from ddpflow.core.errors import UserError
    from ddpflow.engine.resume import Chosen, layout

    def on(world, was=(2, 1, 32)):
        return layout(Chosen(Path("ckpt-000000012.pt"), 12, *was, None), 32, 1, world, "s")

    assert on(2) == (32, 1, None)  # as it was: nothing to say
    assert on(1)[:2] == (32, 2) and on(4)[:2] == (16, 1) and on(8)[:2] == (8, 1)
    assert "BatchNorm statistics come from smaller batches" in on(4)[2]
    assert on(2, was=(1, 4, 8))[:2] == (8, 2)
    with pytest.raises(UserError, match=r"which 3 ranks cannot share evenly; resume on a "
                                        r"number of ranks that divides 64"):
        on(3)
    assert layout(None, 32, 1, 3, "s") == (32, 1, None)


def test_slots_hold_the_same_samples_on_any_number_of_ranks():
    from ddpflow.data.loaders import EpochSampler

    def steps(world, accum, start=0):
        """Per optimizer step, its slots' samples in slot order."""
        per_rank = []
        for r in range(world):
            s = EpochSampler(100, world, r, seed=3, batch=4, accum=accum)
            s.set_epoch(2, start * accum * 4)
            per_rank.append(list(s))
        out = []
        for t in range(len(per_rank[0]) // (4 * accum)):
            slots = {}
            for r in range(world):
                for m in range(accum):
                    at = (t * accum + m) * 4
                    slots[m * world + r] = per_rank[r][at:at + 4]
            out.append([slots[v] for v in sorted(slots)])
        return out

    whole = steps(2, 2)
    assert len(whole) == 6  # 100 // (4 x 2 x 2): the last 4 samples sit the epoch out
    flat = [i for step in whole for slot in step for i in slot]
    assert len(set(flat)) == len(flat) == 96
    assert steps(1, 4) == steps(4, 1) == whole  # the same slots, whoever trains them
    assert steps(4, 1, start=2) == whole[2:]  # resumed after 2 steps: the rest, exactly


def test_a_damaged_sharded_checkpoint_is_skipped_and_an_unfinished_one_removed(tmp_path):
    from ddpflow.core.checksum import sha256_of
    from ddpflow.engine import checkpoint

    folder = tmp_path / "checkpoints"
    for step in (4, 8):
        d = folder / f"ckpt-{step:09d}.dcp"
        d.mkdir(parents=True)
        torch.save({"step": step, "resume_key": "k"}, d / "state.pt")
        (d / "__0_0.distcp").write_bytes(b"shard")
        sums = "".join(f"{sha256_of(f)}  {f.name}\n" for f in sorted(d.iterdir()))
        (folder / f"{d.name}.sha256").write_text(sums)
    (folder / "ckpt-000000008.dcp/__0_0.distcp").write_bytes(b"shorn")
    (folder / ".ckpt-000000012.dcp.tmp").mkdir()
    warned = []
    path, state = checkpoint.latest_valid(folder, "k", warn=lambda *a, **k: warned.append(a))
    assert path.name == "ckpt-000000004.dcp" and state["step"] == 4
    assert "checksum mismatch in __0_0.distcp" in warned[0][0]
    checkpoint.remove_partial(folder)
    assert not (folder / ".ckpt-000000012.dcp.tmp").exists()
    checkpoint.prune(folder, 1)
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt-000000008.dcp",
                                                        "ckpt-000000008.dcp.sha256"]


def test_the_resume_key_leaves_out_what_changes_only_placement_and_memory(tmp_path):
    """A stage that ran out of memory, or comes back on other GPUs, resumes with
    checkpointing, FSDP's units or its ranks changed; the result's own hash keeps them."""
    from ddpflow.config import from_dict

    def hashes(**over):
        raw = tiny_config(tmp_path, stages=[{**FSDP_STAGE, **over.pop("stage", {})}], **over)
        cfg = from_dict(raw)
        return cfg.stage_hash("s1", placement=False), cfg.stage_hash("s1")

    key, result = hashes()
    for other in ({"stage": {"activation_checkpointing": False}},
                  {"stage": {"reshard_after_forward": False}},
                  {"model": {"shard_blocks": ["Sequential"]}},
                  {"hardware": {"nproc_per_node": 1, "threads_per_rank": 2}}):
        k, r = hashes(**other)
        assert k == key and r != result, other
    assert hashes(stage={"lr": 0.1})[0] != key  # what is computed still counts


def test_sync_bn_on_cpu_ranks_is_one_message(tmp_path):
    """SyncBatchNorm runs on GPUs only: on CPU ranks (ddp or fsdp) one message, exit 2,
    no torchrun restarts (before: a traceback per rank, restarted twice)."""
    p = setup_run(tmp_path / "r", {**FSDP_STAGE, "strategy": "ddp"}, model={"sync_bn": True})
    proc = run(tmp_path / "r")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "ddpflow: error: model.sync_bn: SyncBatchNorm runs on GPUs only, and this stage "
        "trains on cpu; set model.sync_bn: false")
    assert p.is_file()


# --------------------------------------------------------------------------- hardening
def test_a_shard_blocks_mistake_is_refused_at_validation_and_by_sweep_plan(tmp_path):
    """`ddpflow validate` and `sweep plan` accepted a class the model does not have; every
    trial then failed at its start. They make launch's check (the model built on the meta
    device, then its blocks), with its one message; nothing is written."""
    wrong = ("model.shard_blocks: 'Bottleneck' is not the class of any module of the model; "
             "model smallcnn has repeated blocks Sequential (3)")
    stage = {**FSDP_STAGE, "activation_checkpointing": False}  # FSDP's units alone
    raw = tiny_config(tmp_path, stages=[stage], model={"shard_blocks": ["Bottleneck"]})
    proc = ddpflow("validate", "--config", write_config(tmp_path, raw))
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"ddpflow: error: {wrong}") and proc.stderr.count("\n") == 1
    # a sweep whose second trial names a class of another model (resnet18's)
    raw = tiny_config(tmp_path, stages=[FSDP_STAGE], model={"shard_blocks": ["Sequential"]},
                      sweep={"grid": {"model.shard_blocks": [["Sequential"], ["BasicBlock"]]}})
    p = write_config(tmp_path, raw, "sweep.yaml")
    for argv in (["sweep", "plan"], ["validate"]):
        proc = ddpflow(*argv, "--config", p)
        assert proc.returncode == 2, proc.stderr
        assert "sweep trial" in proc.stderr and "'BasicBlock' is not the class of any " \
            "module of the model" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "results").exists()
    # and what is right is accepted (the model is built once per distinct setting)
    raw["sweep"]["grid"]["model.shard_blocks"] = [["Sequential"], None]
    assert ddpflow("sweep", "plan", "--config", write_config(tmp_path, raw, "ok.yaml")
                   ).returncode == 0


GUESSING = '''
from torch import nn


def build(num_classes):
    assert num_classes == 3, "made for 3 classes"
    return nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()),
                         nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()), nn.Flatten(),
                         nn.LazyLinear(num_classes))
'''


def test_validation_builds_the_model_only_when_it_must_and_never_on_a_guess(tmp_path,
                                                                          monkeypatch):
    """Only a config with model.kwargs or a stage that shards or recomputes blocks is built
    (torch costs validate seconds); data not prepared yet gives a guessed class count, and a
    builder that fails on it alone is left to launch, which knows the count."""
    from ddpflow.config import from_dict
    from ddpflow.engine.modelcheck import check_model, data_shape, needs_model

    code = tmp_path / "code"
    code.mkdir()
    (code / "guess.py").write_text(GUESSING)
    plain = from_dict(tiny_config(tmp_path))
    assert not needs_model(plain)
    assert data_shape(plain) == (10, 3, True)  # the synthetic set's own count
    folder = from_dict(tiny_config(tmp_path, stages=[FSDP_STAGE], data={
        "source": "imagefolder", "path": str(tmp_path), "train_size": None, "val_size": None,
        "test_size": None}, model={"name": "guess:build", "code_dir": str(code)}))
    assert needs_model(folder) and data_shape(folder) == (2, 3, False)
    check_model(folder)  # the builder fails on the guess: no refusal at validation
    from ddpflow.core.errors import UserError

    kwargs_on_a_guess = from_dict(tiny_config(tmp_path, stages=[FSDP_STAGE], data={
        "source": "imagefolder", "path": str(tmp_path), "train_size": None, "val_size": None,
        "test_size": None}, model={"kwargs": {"bogus": 1}}))
    with pytest.raises(UserError, match="model.kwargs.bogus: smallcnn takes no argument"):
        check_model(kwargs_on_a_guess)  # a kwargs mistake is one whatever the class count
    damaged = tmp_path / "results/t/data"
    damaged.mkdir(parents=True)
    (damaged / "meta.json").write_text("{not json")
    assert data_shape(folder) == (2, 3, False)  # a damaged meta.json: prepare rebuilds it
    synthetic = from_dict(tiny_config(tmp_path, stages=[FSDP_STAGE], model={
        "name": "guess:build", "code_dir": str(code)}))
    from ddpflow.core.errors import UserError

    with pytest.raises(UserError, match="made for 3 classes"):
        check_model(synthetic)  # a count that is known: the builder's refusal stands
    # a sweep's trials that share the model's settings: built once
    from ddpflow.seams import models

    calls, real = [], models.build_model
    monkeypatch.setattr(models, "build_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    seen: set = set()
    fsdp = from_dict(tiny_config(tmp_path, stages=[FSDP_STAGE]))
    for lr in (0.1, 0.2):
        check_model(from_dict(tiny_config(tmp_path, stages=[{**FSDP_STAGE, "lr": lr}])), seen)
    check_model(fsdp)
    assert len(calls) == 2  # one for the two trials, one without `seen`


def test_a_sharded_checkpoints_checksum_file_names_only_files_inside_it(tmp_path, monkeypatch):
    """The sidecar is a manifest ddpflow reads back: a name that leaves the folder ('..', an
    absolute path, a symlink out) is never opened and hashed; the checkpoint is skipped."""
    from ddpflow.engine import checkpoint

    folder = tmp_path / "checkpoints"
    d = folder / "ckpt-000000004.dcp"
    d.mkdir(parents=True)
    torch.save({"step": 4, "resume_key": "k"}, d / "state.pt")
    (tmp_path / "secret").write_bytes(b"not a shard")
    (d / "link.distcp").symlink_to(tmp_path / "secret")
    read = []
    real = checkpoint.sha256_of
    monkeypatch.setattr(checkpoint, "sha256_of", lambda p: read.append(Path(p)) or real(p))
    for name in ("../../secret", str(tmp_path / "secret"), "link.distcp"):
        (folder / f"{d.name}.sha256").write_text(f"{real(tmp_path / 'secret')}  {name}\n"
                                                 f"{real(d / 'state.pt')}  state.pt\n")
        assert checkpoint.verify_folder(d) == ("its checksum file names a file outside the "
                                               "folder (not written by ddpflow)"), name
    assert all(p.resolve().parent == d for p in read) and not any(
        p.resolve() == (tmp_path / "secret") for p in read)


def _tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, words", [
    ("ddp", "not enough free space for the stage's checkpoints at {stage}/checkpoints: about "),
    ("fsdp", "not enough free space for the sharded checkpoint at {stage}/checkpoints: about "),
])
def test_a_full_disk_under_a_stage_is_one_message_from_every_rank(tmp_path, strategy, words):
    """A stage whose checkpoints do not fit (a real 768 KiB tmpfs as results_dir): before,
    FSDP's ranks each printed a 100-line traceback from DCP's C++ writer. Now one message
    naming the place (the ranks refuse together: their needs are gathered first), exit 2,
    no rank's traceback, nothing half-written in the stage folder."""
    _tmpfs(tmp_path / "results", "768k")
    try:
        stage = {**FSDP_STAGE, "strategy": strategy, "activation_checkpointing": False,
                 "max_steps": 8}
        raw = tiny_config(tmp_path, stages=[stage], checkpoint={"every_steps": 4},
                          data={"prepared_dir": str(tmp_path / "data")})
        p = write_config(tmp_path, raw)
        ddpflow("prepare", "--config", p, check=True)
        proc = ddpflow("launch", "--config", p, "--stage", "s1")
        folder = stage_dir(tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "inline_container" not in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("ddpflow: error: " + words.format(stage=folder)), last
        assert last.endswith("free space there or choose another results_dir" if
                             strategy == "fsdp" else "free space there or choose another "
                                                     "place"), last
        assert not [f for f in folder.rglob("*") if ".tmp" in f.name]
        assert not (folder / "final.pt").exists()
    finally:
        subprocess.run(["umount", "-l", str(tmp_path / "results")], check=False)


@pytest.mark.slow
def test_a_disk_that_fills_up_mid_stage_is_one_message(tmp_path):
    """The stage folder's disk fills up while the stage trains (another job's file): rank 0's
    next write (the metrics log, or a checkpoint) is one message naming the place, though
    the folder cannot even take the rank's error.json (it goes to the launcher's spare);
    no rank's traceback, exit 2."""
    _tmpfs(tmp_path / "results", "16m")
    try:
        raw = tiny_config(tmp_path, stages=[{"name": "s1", "epochs": 8, "batch_size": 16,
                                             "lr": 0.05}],
                          checkpoint={"every_steps": 8},
                          data={"prepared_dir": str(tmp_path / "data"), "train_size": 2048})
        p = write_config(tmp_path, raw)
        ddpflow("prepare", "--config", p, check=True)
        from conftest import REPO

        run = subprocess.Popen([sys.executable, "-m", "ddpflow", "launch", "--config", str(p),
                                "--stage", "s1"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        seen = []
        for line in run.stderr:  # a log line after the first checkpoint: training goes on
            seen.append(line)
            if "step 12/" in line:
                break
        with open(tmp_path / "results" / "filler", "wb", buffering=0) as f:  # every page
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        out, err = run.communicate(timeout=300)
        err = "".join(seen) + err
        assert run.returncode == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        folder = stage_dir(tmp_path)
        assert last.startswith("ddpflow: error: ") and f"at {folder}" in last, last
        assert "no space left on the device" in last or "not enough free space" in last, last
    finally:
        subprocess.run(["umount", "-l", str(tmp_path / "results")], check=False)

"""Writing where the user names the place (core/writing.py): one row per class of place,
each asserting the result or the one message, and that nothing of the user's was deleted
or overwritten and nothing partial was left.

Read-only and full places are real tmpfs mounts (the tests run as root, which ignores file
modes); where mounts cannot be made the same OSError is injected at the os level."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ddpflow, tiny_config, write_config
from ddpflow.core import writing
from ddpflow.core.errors import UserError
from ddpflow.data import prepared
from ddpflow.inference import export, predict

WHAT = "the export bundle"


def build_ok(folder: Path) -> str:
    writing.write_bytes_atomic(folder / "model.ts", b"weights")
    writing.write_json_atomic(folder / "model.json", {"ddpflow": "x", "files": {}})
    return "built"


def snapshot(root: Path) -> dict:
    """Every path under root (links not followed) -> its bytes, or None for a folder."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = (None if p.is_dir() or p.is_symlink()
                                             else p.read_bytes())
    return out


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name
                  or ".old-" in p.name or ".tmp" in p.name)


# ---------------------------------------------------------------- build_folder: the table

def user_files(t: Path):
    t.mkdir()
    (t / "notes.txt").write_text("mine")


def a_file(t: Path):
    t.write_text("my file")


def a_link(t: Path):
    (t.parent / "real").mkdir()
    (t.parent / "real" / "keep.txt").write_text("mine")
    t.symlink_to(t.parent / "real")


def marked_plus_user_file(t: Path):
    writing.build_folder(t, build_ok, WHAT)
    (t / "my-notes.md").write_text("added later by the user")


def foreign_model_json(t: Path):
    t.mkdir()
    (t / "model.json").write_text('{"name": "my own model"}')


REFUSED = [("folder of user files", user_files, "already holds files ddpflow did not write"),
           ("a file", a_file, "is a file, not a folder"),
           ("a symlink", a_link, "is a symbolic link"),
           ("ddpflow's folder + a user file", marked_plus_user_file,
            "holds files ddpflow did not write ('my-notes.md')"),
           ("someone else's model.json", foreign_model_json, "did not write ('model.json')")]


@pytest.mark.parametrize("name,make,words", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_place_holding_what_ddpflow_did_not_write_is_refused_untouched(
        tmp_path, name, make, words):
    target = tmp_path / "out dir -x"  # a space and a leading-dash part, on purpose
    make(target)
    before = snapshot(tmp_path)
    with pytest.raises(UserError) as e:
        writing.build_folder(target, build_ok, WHAT, legacy=export.is_bundle)
    msg = str(e.value)
    assert words in msg and str(target) in msg and "choose another --out" in msg, msg
    assert snapshot(tmp_path) == before and not leftovers(tmp_path)


def own_earlier(t: Path):
    writing.build_folder(t, lambda f: (f / "old.bin").write_bytes(b"old"), WHAT)


def empty_folder(t: Path):
    t.mkdir()


def legacy_bundle(t: Path):  # a bundle of a version before the marker
    t.mkdir()
    (t / "model.json").write_text(json.dumps({"ddpflow": "0.1", "files": {}}))
    (t / "model.ts").write_bytes(b"old")


def stale_partial(t: Path):  # a build killed midway, earlier
    (t.parent / f".{t.name}.partial-abc123").mkdir()
    (t.parent / f".{t.name}.partial-abc123" / "model.ts").write_bytes(b"half")


REPLACED = [("nothing there", lambda t: None), ("ddpflow's earlier output", own_earlier),
            ("an empty folder", empty_folder), ("a legacy bundle", legacy_bundle),
            ("a stale partial build", stale_partial)]


@pytest.mark.parametrize("name,make", REPLACED, ids=[r[0] for r in REPLACED])
def test_a_place_that_is_ddpflows_is_built_and_a_users_old_sibling_survives(
        tmp_path, name, make):
    target = tmp_path / "out"
    mine = tmp_path / "out.old"  # the user's own: the old code deleted it
    mine.mkdir()
    (mine / "precious.txt").write_text("mine")
    make(target)
    assert writing.build_folder(target, build_ok, WHAT, legacy=export.is_bundle) == "built"
    assert sorted(os.listdir(target)) == [".ddpflow-output", "model.json", "model.ts"]
    assert (target / "model.ts").read_bytes() == b"weights"
    assert writing.marked_files(target) == {"model.json", "model.ts"}
    assert (mine / "precious.txt").read_text() == "mine" and not leftovers(tmp_path)


def test_a_failed_build_leaves_the_earlier_output_and_no_partial(tmp_path):
    target = tmp_path / "out"
    writing.build_folder(target, build_ok, WHAT)

    def broken(folder):
        (folder / "model.ts").write_bytes(b"half")
        raise RuntimeError("killed midway")

    with pytest.raises(RuntimeError):
        writing.build_folder(target, broken, WHAT)
    assert (target / "model.ts").read_bytes() == b"weights" and not leftovers(tmp_path)


def test_prepare_refuses_a_prepared_dir_of_user_files(tmp_path):
    target = tmp_path / "my-images"
    (target / "cat").mkdir(parents=True)
    (target / "cat" / "1.jpg").write_bytes(b"jpeg")
    with pytest.raises(UserError, match="another data.prepared_dir"):
        prepared.build_into(target, lambda f: {})
    assert (target / "cat" / "1.jpg").read_bytes() == b"jpeg"
    # a prepared folder of a version before the marker is ddpflow's: it may be rebuilt
    old = tmp_path / "data"
    old.mkdir()
    (old / "train_images.npy").write_bytes(b"x")
    (old / "meta.json").write_text(json.dumps({"fingerprint": "f",
                                               "bytes": {"train_images.npy": 1}}))
    assert prepared.build_into(old, lambda f: {"ok": 1}) == {"ok": 1}


# ---------------------------------------------------------------- claim_folder / claim_file

def test_evaluate_folder_written_in_place_keeps_user_files_and_refuses_theirs(tmp_path):
    from ddpflow.inference.evaluate import NAMES
    from ddpflow.inference.evaluate import WHAT as EVAL
    out = tmp_path / "reports"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    writing.claim_folder(out, EVAL, NAMES)  # nothing of ours there yet: write beside
    assert writing.marked_files(out) >= {"metrics.json", "per_class.csv"}
    writing.claim_folder(out, EVAL, NAMES)  # again: ours now
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "metrics.json").write_text('{"mine": 1}')
    with pytest.raises(UserError, match="'metrics.json', not written by ddpflow"):
        writing.claim_folder(theirs, EVAL, NAMES)
    assert (theirs / "metrics.json").read_text() == '{"mine": 1}'
    assert not (theirs / writing.MARKER).exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        writing.claim_folder(tmp_path / "f", EVAL, NAMES)


def test_predictions_csv_replaces_only_its_own(tmp_path):
    ours = tmp_path / "p.csv"
    ours.write_text("path,class,prob,error\n")
    predict._write_csv(ours, ["path", "class", "prob", "error"], [["a.jpg", "cat", 0.5, ""]])
    assert "a.jpg" in ours.read_text()
    theirs = tmp_path / "sales.csv"
    theirs.write_text("month,revenue\n")
    for place, words in ((theirs, "was not written by ddpflow"),
                         (tmp_path, "is a folder, not a file")):
        with pytest.raises(UserError, match=words):
            predict._write_csv(place, ["path", "class", "prob", "error"], [])
    assert theirs.read_text() == "month,revenue\n" and not leftovers(tmp_path)


# ---------------------------------------------------------------- read-only and full places

@pytest.fixture
def place(tmp_path, monkeypatch):
    """place(kind) -> a folder that is read-only ("ro") or 1 MB full-ish ("full"): a real
    tmpfs mount, or, where mounts cannot be made, the same errno injected at the os level."""
    mounts = []

    def make(kind: str) -> Path:
        d = tmp_path / f"mnt-{kind}"
        d.mkdir()
        (d / "before.txt").write_text("mine")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode == 0:
            mounts.append(d)
            (d / "before.txt").write_text("mine")
            if kind == "ro":
                subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
            return d
        _inject(monkeypatch, d, errno.EROFS if kind == "ro" else errno.ENOSPC)
        return d

    yield make
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _inject(monkeypatch, root: Path, code: int) -> None:
    """Fallback: os calls that create or fill something under root fail with `code`."""
    def under(p) -> bool:
        return str(os.fspath(p)).startswith(str(root) + os.sep)

    for fn in ("open", "mkdir", "replace"):
        real = getattr(os, fn)

        def fake(p, *a, _real=real, _fn=fn, **k):
            if under(p) and (code == errno.EROFS or _fn != "mkdir"):
                raise OSError(code, os.strerror(code), str(p))
            return _real(p, *a, **k)
        monkeypatch.setattr(os, fn, fake)
    if code == errno.ENOSPC:
        def no_blocks(*a):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(os, "posix_fallocate", no_blocks)
        monkeypatch.setattr(writing.shutil, "disk_usage",
                            lambda p: type("U", (), {"free": 1 << 20})())  # as the tmpfs


@pytest.mark.parametrize("kind,words", [("ro", "read-only"), ("full", "no space left")])
def test_a_read_only_or_full_place_gives_one_message_and_no_partial(place, kind, words):
    d = place(kind)
    big = b"x" * (2 << 20)  # more than the 1 MB tmpfs holds
    with pytest.raises(UserError) as e:
        writing.write_bytes_atomic(d / "file.bin", big if kind == "full" else b"x")
    assert words in str(e.value) and str(d / "file.bin") in str(e.value)
    target = d / "bundle"
    with pytest.raises(UserError) as e:
        writing.build_folder(target, lambda f: writing.write_bytes_atomic(f / "m.ts", big),
                             WHAT)
    assert words in str(e.value) and f"at {target}:" in str(e.value), str(e.value)
    assert sorted(os.listdir(d)) in (["before.txt"], [".bundle.lock", "before.txt"])
    assert (d / "before.txt").read_text() == "mine"


def test_free_space_is_checked_before_a_cpp_writer(place):
    d = place("full")
    writing.require_free_space(d, 1000, WHAT)
    with pytest.raises(UserError, match=f"not enough free space for {WHAT} at {d}"):
        writing.require_free_space(d, 10 << 20, WHAT)


def test_user_os_error_covers_the_classes():
    for code, words in ((errno.ENOSPC, "no space"), (errno.EDQUOT, "quota"),
                        (errno.EROFS, "read-only"), (errno.EACCES, "permission"),
                        (errno.ENOTDIR, "is a file, not a folder"),
                        (errno.EISDIR, "a folder is where a file belongs"),
                        (errno.ENAMETOOLONG, "too long")):
        err = writing.user_os_error(OSError(code, "x"), "/p", "the thing")
        assert err and words in str(err) and "/p" in str(err)
    assert writing.user_os_error(OSError(errno.EIO, "x"), "/p", "the thing") is None
    with pytest.raises(UserError, match="too long"):
        writing.write_text_atomic(Path("/tmp") / ("n" * 300), "x")


# ---------------------------------------------------------------- two writers at once

HOLD = """
import sys, time
from ddpflow.core import writing
with writing.output_lock(sys.argv[1], "the export bundle"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_writer_at_once_is_told_who_holds_the_place(tmp_path):
    target = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(target)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError) as e:
            writing.build_folder(target, build_ok, WHAT)
        assert f"pid {holder.pid}" in str(e.value) and str(target) in str(e.value)
        assert not target.exists() and not leftovers(tmp_path)
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------- the real commands

def test_cli_export_prepare_and_predict_refuse_a_place_of_user_files(tmp_path):
    """`ddpflow export --out DIR` used to delete DIR's files (and DIR.old) and exit 0."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (tmp_path / "mine.old").mkdir()
    (tmp_path / "mine.old" / "backup.tex").write_text("older work")
    before = snapshot(tmp_path)
    raw = tiny_config(tmp_path, data={"train_size": 64, "val_size": 16, "test_size": 16,
                                      "prepared_dir": str(mine)})
    r = ddpflow("prepare", "--config", write_config(tmp_path, raw))
    assert r.returncode == 2 and str(mine) in r.stderr and "Traceback" not in r.stderr, r.stderr
    raw["data"].pop("prepared_dir")
    p = write_config(tmp_path, raw)
    ddpflow("prepare", "--config", p, check=True)
    r = ddpflow("export", "--config", p, "--out", mine)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{mine} already holds files ddpflow did not write ('thesis.tex')" in r.stderr
    r = ddpflow("predict", "--bundle", tmp_path / "nothing", "--out", mine / "thesis.tex",
                tmp_path)
    assert r.returncode == 2 and "was not written by ddpflow" in r.stderr, r.stderr
    after = {k: v for k, v in snapshot(tmp_path).items() if k in before}
    assert after == before and sorted(os.listdir(mine)) == ["thesis.tex"]


def test_snakemake_deleted_the_output_file_of_an_older_version(tmp_path):
    """Snakemake deletes model.json / meta.json before the job that remakes them: an older
    version's output without them is ddpflow's in its own place, not under a named --out."""
    bundle = tmp_path / "export"
    bundle.mkdir()
    (bundle / "model.ts").write_bytes(b"old")
    assert export.is_bundle(bundle, strict=False) and not export.is_bundle(bundle)
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train_images.npy", "val_labels.npy", "test-00000.jpgs", "test_index.npy"):
        (data / name).write_bytes(b"x")
    assert prepared.build_into(data, lambda f: {"ok": 1}, own_place=True) == {"ok": 1}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train_images.npy").write_bytes(b"x")
    with pytest.raises(UserError, match="did not write"):
        prepared.build_into(mine, lambda f: {}, own_place=False)
    assert (mine / "train_images.npy").read_bytes() == b"x"


def test_move_into_place_and_preallocate(tmp_path, place):
    src = tmp_path / ".image.sif.tmp"
    src.write_bytes(b"built")
    writing.move_into_place(src, tmp_path / "image.sif")
    assert (tmp_path / "image.sif").read_bytes() == b"built" and not src.exists()
    (tmp_path / "d").mkdir()
    src.write_bytes(b"x")
    with pytest.raises(UserError, match="a folder is where a file belongs"):
        writing.move_into_place(src, tmp_path / "d")
    d = place("full")
    with open(d / "sparse", "wb") as f:
        f.truncate(4 << 20)  # a 4 MB sparse file on a 1 MB tmpfs: its blocks do not fit
    with pytest.raises(OSError) as e:
        writing.preallocate(d / "sparse")
    assert e.value.errno == errno.ENOSPC


# ---------------------------------------------------------------- the C++ writers

NATIVE_WRITERS = {  # what each writer does on a place; run in a child (TorchScript aborts)
    "torch.save": "import torch; torch.save({'w': torch.randn(200_000)}, PATH + '/a.pt')",
    "dcp": ("import torch, torch.distributed.checkpoint as dcp; "
            "dcp.save({'w': torch.randn(200_000)}, checkpoint_id=PATH + '/ck', no_dist=True)"),
    "safetensors": ("import torch; from safetensors.torch import save_file; "
                    "save_file({'w': torch.randn(200_000)}, PATH + '/m.safetensors')"),
    "onnx": ("import torch, warnings; warnings.simplefilter('ignore'); "
             "torch.onnx.export(torch.nn.Linear(400, 500), (torch.randn(2, 400),), "
             "PATH + '/m.onnx', dynamo=False)"),
}
RAISE = """
import sys
from ddpflow.core.nativewrite import native_error
PATH = sys.argv[1]
try:
    {code}
except BaseException as e:
    user = native_error(e, PATH, "the export bundle")
    print("RAISED", type(e).__name__)
    print("USER", user)
"""


@pytest.mark.parametrize("kind,words", [("full", "no space left on the device"),
                                        ("ro", "the file system is read-only")])
@pytest.mark.parametrize("writer", sorted(NATIVE_WRITERS))
def test_each_cpp_writers_error_of_a_place_is_one_message(place, kind, words, writer):
    """The real writers on a real full / read-only tmpfs: torch.save's `unexpected pos`,
    DCP's CheckpointException (a BaseException with a traceback per rank), safetensors'
    SafetensorError and the exporter's OSError all become one message naming the place."""
    d = place(kind)
    if kind == "full":
        (d / "filler").write_bytes(b"\0" * (1000 << 10))  # what is left: a few KB
    code = RAISE.format(code=NATIVE_WRITERS[writer])
    proc = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True,
                          timeout=300)
    assert "RAISED" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert f"USER cannot write the export bundle at {d}: {words}" in proc.stdout, proc.stdout


def test_other_errors_stay_what_they_are():
    from ddpflow.core.nativewrite import native_error

    assert native_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "/p",
                        "x") is None
    assert native_error(ValueError("bad opset"), "/p", "x") is None
    err = native_error(RuntimeError("[enforce fail at inline_container.cc:432] . open file "
                                    "failed because of errno 2 on fopen: No such file or "
                                    "directory, file path: /p/m.ts"), "/p", "the bundle")
    assert isinstance(err, UserError) and "torch's writer stopped (open file failed" in str(err)
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert "disk quota exceeded" in str(native_error(wrapped, "/p", "x"))


TORCHSCRIPT = """
import sys, torch
from pathlib import Path
from ddpflow.inference import export
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 5_000)).eval()
x = torch.rand(4, 3, 8, 8)
try:
    export._write_format("torchscript", model, x, model(x), Path(sys.argv[1]) / "model.ts")
except Exception as e:
    print("ERROR", type(e).__name__, e)
"""


def test_torchscript_never_starts_on_a_place_it_cannot_fill(place):
    """TorchScript's zip writer throws from a destructor on a full disk: std::terminate,
    SIGABRT, a half file. Its free space is checked first, with a margin for the weights it
    is about to write (a 3.9 MB model on a 1 MB tmpfs)."""
    d = place("full")
    proc = subprocess.run([sys.executable, "-c", TORCHSCRIPT, str(d)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-1500:]}"
    assert (f"ERROR UserError not enough free space for the export bundle at {d}: about "
            f"4.9 MB needed, 1.0 MB free") in proc.stdout, proc.stdout + proc.stderr[-1500:]
    assert sorted(os.listdir(d)) == ["before.txt"]


def test_a_checkpoint_file_on_a_full_or_read_only_place(place):
    """checkpoint.write_atomic (every ckpt-*.pt, best.pt, final.pt, a sharded state.pt):
    checked first, one message naming the file, no temp file left."""
    from ddpflow.engine import checkpoint

    places = {}
    for kind, words in (("full", "not enough free space for the stage's checkpoints at"),
                        ("ro", "cannot write the stage's checkpoints at")):
        d = places[kind] = place(kind)
        with pytest.raises(UserError) as e:
            checkpoint.write_atomic(d / "ckpt-000000008.pt", b"x" * (2 << 20))
        assert words in str(e.value) and str(d) in str(e.value), str(e.value)
        assert not [p for p in d.rglob("*") if ".tmp" in p.name]
    with pytest.raises(UserError, match="the file system is read-only"):
        checkpoint.write_atomic(places["ro"] / "small.pt", b"x" * 1000)
    checkpoint.write_atomic(places["full"] / "small.pt", b"x" * 1000)  # fits: written
    assert (places["full"] / "small.pt").read_bytes() == b"x" * 1000


def test_the_ranks_of_a_sharded_checkpoint_refuse_together(tmp_path):
    """FSDP: every rank writes its shards into one file system; their needs are summed per
    file system and every rank gets the same refusal (no rank goes into DCP's collectives
    alone)."""
    from ddpflow.engine.shardedckpt import check_room

    rooms = [("n1", 7, 10_000_000, 6_000_000), ("n1", 7, 10_000_000, 6_000_000)]
    with pytest.raises(UserError) as e:
        check_room(rooms, tmp_path)
    assert (f"not enough free space for the sharded checkpoint at {tmp_path}: about 12.0 MB "
            f"needed by 2 rank(s), 10.0 MB free") in str(e.value)
    check_room([("n1", 7, 10_000_000, 6_000_000), ("n2", 7, 10_000_000, 6_000_000)], tmp_path)
    check_room([("n1", 7, 10_000_000, 6_000_000), ("n1", 8, 10_000_000, 6_000_000)], tmp_path)
    with pytest.raises(UserError, match="needed by 1 rank"):
        check_room([("n1", 7, 10_000_000, 6_000_000), ("n1", 8, 5_000_000, 6_000_000)],
                   tmp_path)


def test_the_metrics_log_on_a_full_disk_is_one_message_of_rank_0(place):
    """metrics.jsonl is appended by rank 0 alone while the others train on: a full stage
    folder is one message naming it, raised as rank 0's alone (it waits to be stopped with
    them, no peer traceback)."""
    from ddpflow.core.errors import OneRankError
    from ddpflow.results.metrics import MetricsLog

    d = place("full")
    log = MetricsLog(d / "metrics.jsonl", keep_until_step=None)
    with pytest.raises(OneRankError) as e:
        for step in range(100):
            log.write({"step": step, "note": "x" * (64 << 10)})
    assert str(e.value).startswith(f"cannot write the stage's metrics log at {d / 'metrics.jsonl'}"
                                   f": no space left on the device")


def test_a_ranks_report_goes_to_the_launchers_spare_when_its_folder_is_full(place, tmp_path,
                                                                          monkeypatch, capsys):
    """The mistake may be that the stage folder's disk is full: error.json then goes to the
    launcher's scratch folder (DDPFLOW_RANK_ERROR), which the launcher reads too."""
    from ddpflow.launch import rankerror

    d = place("full")
    with open(d / "filler", "wb", buffering=0) as f:  # full to the last page
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
    err = UserError("cannot write the stage's metrics log at x: no space left on the device")
    with rankerror.Reports(d / "stage") as reports:
        monkeypatch.setenv(rankerror.SPARE, reports.env[rankerror.SPARE])
        assert not reports.is_file()
        rankerror.report(d / "stage", err)
        assert reports.is_file() and reports.message() == str(err)
        assert not (d / "stage" / "error.json").exists()
        spare = reports.paths[1]
    assert not spare.parent.exists()  # the scratch folder goes with the run
    monkeypatch.setenv(rankerror.SPARE, str(tmp_path / "elsewhere" / "error.json"))
    with pytest.raises(UserError):  # no spare on this node: said on stderr, then raised
        rankerror.report(d / "stage", err)
    assert capsys.readouterr().err == f"ddpflow: error: {err}\n"
    ok = tmp_path / "stage"
    with rankerror.Reports(ok) as reports:
        rankerror.report(ok, err)  # a folder that takes it: there
        assert (ok / "error.json").is_file() and reports.message() == str(err)

"""The Slurm and container settings, and two faults of real processes (hardening issue).

Slurm: every `slurm:` value that reaches sbatch (partition, account, gpu_model, gres, extra,
sizes, the signal's time) is the right sbatch option or one config message naming the key;
slurm.extra never reaches the executor's shell as anything but plain option words.
Containers: an engine that is absent or does not answer, and each container value, is one
message naming it (no Docker SDK traceback). No Slurm cluster and no engine is started.
Faults: a `sweep collect` killed (SIGKILL) while it writes leaves no leaderboard that looks
complete, and the next collect writes all of it; two `ddpflow prepare` of one folder at once:
one builds, the other exits 2 naming the holder.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, ddpflow, tiny_config, write_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.core.quoting import shell_line

SMK = REPO / "workflow/rules/common.smk"


def _refused(tmp_path, **top) -> str:
    with pytest.raises(UserError) as e:
        from_dict(tiny_config(tmp_path, **top))
    text = str(e.value)
    assert text.startswith("invalid config: ") and "\n" not in text, text
    return text


# --------------------------------------------------------------------------- Slurm

SLURM_ROWS = [  # (slurm: section, the key named, words of the message)
    ({"partition": "gpu long"}, "slurm.partition", "is not a Slurm partition"),
    ({"partition": "gpu'"}, "slurm.partition", "no spaces, quotes"),
    ({"partition": "gpu;reboot"}, "slurm.partition", "';'"),
    ({"partition": "gpu\nx"}, "slurm.partition", "is not a Slurm partition"),
    ({"partition": "gpu\n"}, "slurm.partition", "is not a Slurm partition"),  # $ before \n
    ({"account": "proj 1"}, "slurm.account", "is not a Slurm account"),
    ({"account": "$(id)"}, "slurm.account", "is not a Slurm account"),
    ({"gpu_model": "a100;x"}, "slurm.gpu_model", "is not a Slurm gpu model"),
    ({"extra": "--mail-user='me@x.org'"}, "slurm.extra", "\"'\""),
    ({"extra": "--mail-user=$(touch${IFS}/tmp/owned)"}, "slurm.extra", "'$', '(', ')'"),
    ({"extra": "--begin=now;reboot"}, "slurm.extra", "';'"),
    ({"extra": "--x=`id`"}, "slurm.extra", "'`'"),
    ({"extra": "--mail-type=END\n--exclusive"}, "slurm.extra", None),  # newline: a space
    ({"extra": "--mem=4G"}, "slurm.extra", "set slurm.mem_mb instead"),
    ({"extra": "--signal=B:USR1@60"}, "slurm.extra", "set slurm.signal_before_end_s"),
    ({"extra": "-p long"}, "slurm.extra", "set slurm.partition instead"),
    ({"extra": "--qos=high"}, "slurm.extra", "--set-resources"),
    ({"gres": "gpu"}, "slurm.gres", "is not gpu:N or gpu:type:N"),
    ({"gres": "gpu:a100:two"}, "slurm.gres", "is not gpu:N"),
    ({"gres": "gpu:0"}, "slurm.gres", "asks for no GPU"),
    ({"gres": "gpu:2", "gpus": 4}, "slurm.gres", "asks for 2 GPU(s) and slurm.gpus for 4"),
    ({"gpus": 0, "gpu_model": "a100"}, "slurm.gpu_model", "slurm.gpus is 0"),
    ({"gpus": -1}, "slurm.gpus", "less than the minimum of 0"),
    ({"gpus": 100000}, "slurm.gpus", "greater than the maximum"),
    ({"cpus": 0}, "slurm.cpus", "less than the minimum of 1"),
    ({"cpus_per_gpu": 0}, "slurm.cpus_per_gpu", "less than the minimum of 1"),
    ({"mem_mb": 0}, "slurm.mem_mb", "less than the minimum of 256"),
    ({"mem_mb": 10**12}, "slurm.mem_mb", "greater than the maximum"),
    ({"runtime_min": 0}, "slurm.runtime_min", "less than the minimum of 1"),
    ({"runtime_min": 3, "signal_before_end_s": 180}, "slurm.signal_before_end_s",
     "must come before the end; set it below 180"),
    ({"runtime_min": 5, "signal_before_end_s": 300}, "slurm.signal_before_end_s",
     "below 300"),
    ({"signal_before_end_s": 70000}, "slurm.signal_before_end_s", "greater than the maximum"),
]


@pytest.mark.parametrize("slurm, key, words", SLURM_ROWS,
                         ids=[f"{r[1]}-{i}" for i, r in enumerate(SLURM_ROWS)])
def test_a_slurm_value_sbatch_cannot_take_is_one_message(tmp_path, slurm, key, words):
    if words is None:  # accepted: a newline only separates words, as a space does
        assert from_dict(tiny_config(tmp_path, slurm=slurm)).slurm.extra == slurm["extra"]
        return
    text = _refused(tmp_path, slurm=slurm)
    assert key in text and words in text, text


# slurm.extra as sbatch reads it (getopt_long): a row per class, the option named as written
# and as sbatch takes it, and the key (or reason) instead
SBATCH_ROWS = [
    ("--partiti=pair", "sets --partition (sbatch reads --partiti as --partition), which "
                       "slurm.extra may not set: set slurm.partition instead"),
    ("--mail-type=END --outp=x.log", "sets --output (sbatch reads --outp as --output)"),
    ("--chd=.", "sets --chdir (sbatch reads --chd as --chdir)"),
    ("-p pair", "sets --partition (sbatch reads -p as --partition)"),
    ("-ppair", "sets --partition (sbatch reads -p as --partition)"),
    ("-OH", "sets --hold (sbatch reads -H as --hold), which slurm.extra may not set: a held job "
            "never starts, and the workflow would wait for it forever"),
    ("--wrap=true", "sets --wrap, which slurm.extra may not set: the executor's job script "
                    "runs the stage; --wrap would run another command"),
    ("--array=1-100", "sets --array, which slurm.extra may not set: an array job would run "
                      "the stage as many times at once"),
    ("--hold", "sets --hold,"),
    ("-Q", "sets --quiet (sbatch reads -Q as --quiet), which slurm.extra may not set: sbatch "
           "would not print the job's id"),
    ("--begin=now+3650days", "sets --begin, which slurm.extra may not set: a job that may not "
                             "start before a later time keeps the workflow waiting"),
    ("--dependency=afterok:12", "sets --dependency, which slurm.extra may not set: Snakemake "
                                "orders the jobs"),
    ("--test", "sets --test-only (sbatch reads --test as --test-only)"),
    ("-A proj", "set slurm.account instead"),
    ("--gpus=8", "set slurm.gpus (and slurm.gres or slurm.gpu_model) instead"),
    ("--gpus-per-t=1", "sets --gpus-per-task (sbatch reads --gpus-per-t as --gpus-per-task)"),
    ("-c 4", "set slurm.cpus (a job without GPUs) or slurm.cpus_per_gpu instead"),
    ("--mem-per-g=4G", "sets --mem-per-gpu (sbatch reads --mem-per-g as --mem-per-gpu)"),
    ("-t 60", "set slurm.runtime_min instead"),
    ("-N 2", "set hardware.nodes and hardware.nproc_per_node instead"),
    ("-J name", "the Slurm executor sets it (a per-rule resource"),
    ("--uid=0", "it runs the job as another user"),
    ("--help", "sbatch would print and exit"),
    ("--con=x", "has --con, which is ambiguous to sbatch (it could be --constraint, "
                "--container, --context, --contiguous): write the whole option"),  # 4: all
    ("--ex", "has --ex, which is ambiguous to sbatch (it could be --exclude, --exclusive, "
             "--export, --export-file ...): write the whole option"),  # 5: the first 4
    ("--mail=END", "has --mail, which is ambiguous to sbatch (it could be --mail-type, "
                   "--mail-user): write the whole option"),
    ("--exc", "it could be --exclude, --exclusive"),
    ("--bogus=1", "has --bogus, which is not an sbatch option"),
    ("-X", "has -X (in -X), which is not an sbatch option"),
    ("--nice 5", "has '5', which is no option: sbatch would take it (and every word after it) "
                 "as the job's script"),
    ("pair", "has 'pair', which is no option"),
    ("-- --hold", "has '--', which is no option"),
    ("--mail-type", "ends with --mail-type, which needs a value"),
    ("-w", "ends with -w, which needs a value"),
    ("--hold=yes", "has --hold=yes, but --hold takes no value"),
    # accepted: options a user may add, as sbatch takes them
    ("--mail-t=END --mail-user=me@x.org", None),
    ("--exclusive -w n1 --reservation r1 -Ok", None),
    ("--nice=5 --requeue --tmp=100 -x n2", None),
    ("--gpus-per-node=8", None),  # a site's per-node request beside the total (slurm.md)
]


@pytest.mark.parametrize("extra, words", SBATCH_ROWS, ids=[r[0] for r in SBATCH_ROWS])
def test_slurm_extra_is_read_as_sbatch_reads_it(tmp_path, extra, words):
    """A deny list of whole names passed `--partiti=pair --outp=x.log --chd=.` (sbatch takes
    any unambiguous prefix) and `--wrap=true`, `--array=1-100`, `--hold`: now an allow-list,
    matched as sbatch matches (prefixes, -x short forms and bundles, =/space values)."""
    if words is None:
        assert from_dict(tiny_config(tmp_path, slurm={"extra": extra})).slurm.extra == extra
        return
    text = _refused(tmp_path, slurm={"extra": extra})
    assert text.startswith("invalid config: slurm.extra ") and words in text, text


def test_every_sbatch_option_is_allowed_or_named_with_what_to_do():
    from ddpflow.config import sbatchopts

    assert len(sbatchopts.LONG) == 106 and set(sbatchopts.SHORT.values()) <= set(
        sbatchopts.LONG)
    assert not sbatchopts.ALLOWED & set(sbatchopts.MANAGED)
    assert sbatchopts.ALLOWED | set(sbatchopts.MANAGED) == set(sbatchopts.LONG)
    for name in ("partition", "account", "gpus", "cpus-per-task", "mem", "time", "output",
                 "array", "wrap", "hold", "dependency", "test-only"):
        assert name in sbatchopts.MANAGED, name


def _slurm_resources():
    """common.smk's slurm_resources, as the workflow defines it (the .smk file itself)."""
    src = SMK.read_text()
    start = src.index("def slurm_resources(")
    end = src.index("\ndef ", start + 1)
    scope = {"shell_line": shell_line, "config": None}
    exec(compile(src[start:end], str(SMK), "exec"), scope)
    return scope["slurm_resources"]


@pytest.mark.parametrize("extra", ["", "--mail-type=END --mail-user=me@x.org",
                                   "--mail-type=END\n--exclusive", "--exclusive",
                                   "-w n1 --reservation=r1"])
def test_accepted_slurm_values_reach_sbatch_as_separate_options(tmp_path, extra):
    """What the executor plugin's sbatch line (a shell line) makes of slurm_extra: one argv
    word per option, the signal first; partition and account as given."""
    from types import SimpleNamespace

    from snakemake_executor_plugin_slurm.submit_string import get_submit_command

    cfg = from_dict(tiny_config(tmp_path, slurm={
        "extra": extra, "partition": "gpu,long", "account": "proj-1.a", "gpus": 2,
        "runtime_min": 60, "signal_before_end_s": 120}))
    res = _slurm_resources()(cfg.to_dict())

    class Res(dict):
        __getattr__ = dict.get

    job = SimpleNamespace(resources=Res(res), is_group=lambda: False, threads=1)
    params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c",
              "account": f"-A {shlex.quote(cfg.slurm.account)}",
              "partition": f"-p {shlex.quote(cfg.slurm.partition)}", "workdir": "/w"}
    argv = shlex.split(get_submit_command(job, params))
    want = ["--signal=USR1@120", *extra.split()]
    i = argv.index(want[0])
    assert argv[i:i + len(want)] == want, argv
    assert argv[argv.index("-p") + 1] == "gpu,long" and argv[argv.index("-A") + 1] == "proj-1.a"


# sinfo -h -N -o '%P|%N|%c|%m|%G' of a cluster: a small GPU node and a big one in gpu (the
# default partition), two CPU nodes in cpu, an 8-GPU node of 2 TB in big, and in mixed three
# nodes of different sizes, the largest (m2) neither first nor last
SINFO = """gpu*|g1|16|120000|gpu:a100:4(S:0-1)
gpu*|g2|64|500000|gpu:a100:4(S:0-1)
cpu|c1|32|64000|(null)
cpu|c2|32|64000|(null)
big|b1|128|2000000|gpu:h100:8
mixed|m1|32|256000|gpu:4
mixed|m2|64|1000000|gpu:a100:4,gpu:h100:4
mixed|m3|16|128000|gpu:2
"""


def _sized(tmp_path, found="sinfo", **top) -> dict:
    """The slurm: section `ddpflow validate` prints for a config, given what sinfo says."""
    from ddpflow.launch.slurmsizes import parse_sinfo, resolve

    found = parse_sinfo(SINFO) if found == "sinfo" else found
    return resolve(from_dict(tiny_config(tmp_path, **top)).to_dict(), found)


def test_sinfo_gres_fields_give_the_gpus_of_a_node():
    from ddpflow.launch.slurmsizes import gres_gpus, parse_sinfo

    assert [gres_gpus(g) for g in ("gpu:2", "gpu:a100:4(S:0-1)", "gpu:a:2,gpu:b:2",
                                   "(null)", "shard:8", "mps:100,gpu:1")] == [2, 4, 4, 0, 0, 1]
    parts, default = parse_sinfo(SINFO)
    assert default == "gpu" and sorted(parts) == ["big", "cpu", "gpu", "mixed"]
    assert [(n.name, n.cpus, n.mem_mb, n.gpus) for n in parts["gpu"]] == [
        ("g1", 16, 120000, 4), ("g2", 64, 500000, 4)]


@pytest.mark.parametrize("slurm, want", [
    ({}, (4, 30000)),  # a GPU's share of the smallest node of the default partition (g1)
    ({"gpus": 2}, (4, 60000)),
    ({"partition": "gpu"}, (4, 30000)),
    ({"partition": "big", "gpus": 8}, (8, 8 * 64000)),  # capped: 8 cores, 64000 MiB a GPU
    ({"partition": "cpu", "gpus": 0, "cpus": 4}, (None, 8000)),  # 4 cores' share of 64000
    ({"partition": "cpu,big", "gpus": 0, "cpus": 4}, (None, 8000)),  # both: the smaller
    ({"cpus_per_gpu": 2, "mem_mb": 1000}, (2, 1000)),  # given: they win
    ({"partition": "nosuch"}, (4, 16000)),  # a partition sinfo does not list: fallbacks
])
def test_slurm_sizes_left_open_are_a_gpus_share_of_a_node(tmp_path, slurm, want):
    s = _sized(tmp_path, slurm=slurm)
    assert (s["cpus_per_gpu"] if s["gpus"] else None, s["mem_mb"]) == want, s


def test_slurm_sizes_without_sinfo_and_of_sweeps_and_several_nodes(tmp_path):
    assert (_sized(tmp_path, found=None)["cpus_per_gpu"],
            _sized(tmp_path, found=None)["mem_mb"]) == (4, 16000)
    # a sweep's jobs are its trials: one GPU each here, not the base config's 4
    swept = _sized(tmp_path, slurm={"gpus": 4},
                   sweep={"grid": {"seed": [0, 1]}, "gpus_per_trial": 1})
    assert swept["mem_mb"] == 30000
    # two nodes: --mem is per node, --gpus the job's total (4 = 2 a node); gres is per node
    two = {"nodes": 2, "nproc_per_node": 2}
    assert _sized(tmp_path, hardware=two, slurm={"gpus": 4})["mem_mb"] == 60000
    assert _sized(tmp_path, hardware=two, slurm={"gres": "gpu:4"})["mem_mb"] == 120000


@pytest.mark.parametrize("slurm, words", [
    ({"partition": "gpu", "mem_mb": 600000},
     "slurm.mem_mb is 600000 MiB but the largest node of partition gpu has 500000 MiB (g2); "
     "set slurm.mem_mb to at most 500000, or null"),
    ({"partition": "gpu", "gpus": 4, "cpus_per_gpu": 20},
     "slurm.cpus_per_gpu 20 x 4 GPU(s) per node is 80 cores but the largest node of "
     "partition gpu has 64; set slurm.cpus_per_gpu to at most 16"),
    ({"partition": "cpu", "gpus": 0, "cpus": 48},
     "slurm.cpus is 48 but the largest node of partition cpu has 32 cores"),
    # mixed: just above its largest node (m2), each size
    ({"partition": "mixed", "mem_mb": 1000001},
     "slurm.mem_mb is 1000001 MiB but the largest node of partition mixed has 1000000 MiB "
     "(m2); set slurm.mem_mb to at most 1000000, or null"),
    ({"partition": "mixed", "gpus": 2, "cpus_per_gpu": 33},
     "slurm.cpus_per_gpu 33 x 2 GPU(s) per node is 66 cores but the largest node of "
     "partition mixed has 64; set slurm.cpus_per_gpu to at most 32"),
    ({"partition": "mixed", "gpus": 0, "cpus": 65},
     "slurm.cpus is 65 but the largest node of partition mixed has 64 cores"),
    ({"partition": "mixed", "gpus": 9},
     "slurm.gpus asks for 9 GPU(s) per node but the largest node of partition mixed has 8 "
     "(m2); ask for at most 8 GPU(s) a node"),
    ({"partition": "mixed", "gres": "gpu:9"},
     "slurm.gres asks for 9 GPU(s) per node but the largest node of partition mixed has 8"),
    ({"partition": "gpu,mixed", "gpus": 9}, "the largest node of partition gpu,mixed has 8"),
])
def test_a_slurm_size_no_node_has_is_one_message(tmp_path, slurm, words):
    with pytest.raises(UserError) as e:
        _sized(tmp_path, slurm=slurm)
    assert str(e.value).startswith("invalid config: ") and words in str(e.value), e.value
    assert "\n" not in str(e.value) and str(e.value).count("largest node") == 1, e.value
    # the same size without a named partition (a local run where sinfo is) is not refused
    _sized(tmp_path, slurm={k: v for k, v in slurm.items() if k != "partition"},
           found=({"gpu": []}, "gpu"))


@pytest.mark.parametrize("slurm, top, want", [
    # between the smallest node of mixed (m3) and the largest (m2): some node takes it
    ({"mem_mb": 200000}, {}, {"mem_mb": 200000}),
    ({"gpus": 2, "cpus_per_gpu": 12}, {}, {"cpus_per_gpu": 12}),  # 24 cores: m1, m2
    ({"gpus": 0, "cpus": 40}, {}, {"cpus": 40}),
    ({"gpus": 4}, {}, {"gpus": 4}),  # m1, m2
    ({"gres": "gpu:4"}, {}, {"gres": "gpu:4"}),
    ({"gpus": 8}, {"hardware": {"nodes": 2, "nproc_per_node": 2}}, {"gpus": 8}),  # 4 a node
    # exactly the largest node (m2): only it takes it
    ({"mem_mb": 1000000}, {}, {"mem_mb": 1000000}),
    ({"gpus": 2, "cpus_per_gpu": 32}, {}, {"cpus_per_gpu": 32}),  # 64 cores
    ({"gpus": 0, "cpus": 64}, {}, {"cpus": 64}),
    ({"gpus": 8}, {}, {"gpus": 8}),
    ({"gres": "gpu:h100:8", "cpus_per_gpu": 8, "mem_mb": 1000000}, {},
     {"gres": "gpu:h100:8", "cpus_per_gpu": 8, "mem_mb": 1000000}),
    ({"gpus": 8, "cpus_per_gpu": 8}, {"sweep": {"grid": {"seed": [0, 1]}, "gpus_per_trial": 8}},
     {"cpus_per_gpu": 8}),
])
def test_a_slurm_size_some_node_has_is_asked_for_as_it_is(tmp_path, slurm, top, want):
    """Sizes the smallest node lacks but a larger one has are the user's to ask for: sbatch
    finds that node (a check against the smallest, or the first listed, would refuse)."""
    s = _sized(tmp_path, slurm={"partition": "mixed", **slurm}, **top)
    assert {k: s[k] for k in want} == want, s


def test_validate_prints_the_slurm_sizes_it_derives(tmp_path, monkeypatch):
    """`ddpflow validate` (what the workflow reads) fills the sizes; no sinfo: fallbacks."""
    import yaml

    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))
    path = write_config(tmp_path, tiny_config(tmp_path))
    out = subprocess.run([sys.executable, "-m", "ddpflow", "validate", "--config", path],
                         capture_output=True, text=True, check=True).stdout
    s = yaml.safe_load(out)["slurm"]
    assert (s["cpus_per_gpu"], s["mem_mb"]) == (4, 16000)


@pytest.mark.parametrize("tres, slurm, want", [
    ("cpu=8,mem=2000M,node=2,billing=8,gres/gpu=4", {"gpus": 4},
     ["--cpus-per-task=4", "--gres=gpu:2"]),
    ("cpu=4,mem=1000M,node=2,billing=4", {"gpus": 0, "cpus": 2}, ["--cpus-per-task=2"]),
    (None, {"gpus": 4, "cpus_per_gpu": 3}, ["--cpus-per-task=6", "--gres=gpu:2"]),
    (None, {"gres": "gpu:4", "cpus_per_gpu": 2}, ["--cpus-per-task=8", "--gres=gpu:4"]),
    (None, {"gpus": 0, "cpus": 5}, ["--cpus-per-task=5"]),
])
def test_the_several_node_srun_step_asks_for_its_cpus_and_gpus(tmp_path, monkeypatch, tres,
                                                               slurm, want):
    """Slurm >= 22.05: srun does not take --cpus-per-task from the batch job. The step asks
    for what the job holds on each node (scontrol's TRES), else what the config asks."""
    from ddpflow.launch import slurmnodes

    fields = {"TRES": tres, "NodeList": "n[1-2]"} if tres else {}
    monkeypatch.setattr(slurmnodes, "_job_fields", lambda job: fields)
    monkeypatch.setattr(slurmnodes, "slurm_hosts", lambda: ["n1", "n2"])
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    cfg = from_dict(tiny_config(tmp_path, hardware={"nodes": 2, "nproc_per_node": 2},
                                slurm=slurm))
    cmd = slurmnodes.srun_command(cfg, 2, tmp_path / "config.json", "--max-restarts=0", [])
    step = cmd[:cmd.index("--kill-on-bad-exit=1")]
    assert step == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", *want], cmd


# --------------------------------------------------------------------------- containers

CONTAINER_ROWS = [  # (container: section, the key named, words of the message)
    ({"shm_size": "16 GB"}, "container.shm_size", "is not a size"),
    ({"shm_size": "16gb"}, "container.shm_size", "write it like 16g or 512m"),
    ({"shm_size": "-1g"}, "container.shm_size", "16g"),
    ({"image": "DDPflow:1"}, "container.image", "is not an image reference"),
    ({"image": "ddpflow:la test"}, "container.image", "a tag of letters"),
    ({"image": "ddpflow:$(id)"}, "container.image", "is not an image reference"),
    ({"image": "ddpflow:"}, "container.image", "is not an image reference"),
    ({"image": "ddpflow:latest\n"}, "container.image", "is not an image reference"),
    ({"image": "ddpflow:" + "x" * 200}, "container.image", "at most 128"),
    ({"base_image": "pytorch/pytorch:2.4 cuda"}, "container.base_image", "not an image"),
    ({"uri": "ddpflow:latest"}, "container.uri", "needs docker:// in front"),
    ({"uri": "docker://"}, "container.uri", "has no image after the scheme"),
    ({"uri": "docker://Org/Bad Name"}, "container.uri", "which is not an image"),
    ({"uri": "docker://x;rm -rf ~"}, "container.uri", "which is not an image"),
    ({"uri": "https://example.org/x.sif"}, "container.uri", "is not docker://"),
    ({"uri": "docker://org/ddpflow:1.0", "engine": "docker"}, "container.uri",
     "drop the uri or change the engine"),
]


@pytest.mark.parametrize("container, key, words", CONTAINER_ROWS,
                         ids=[f"{r[1]}-{i}" for i, r in enumerate(CONTAINER_ROWS)])
def test_a_container_value_the_engines_refuse_is_one_message(tmp_path, container, key, words):
    text = _refused(tmp_path, container=container)
    assert key in text and words in text, text


@pytest.mark.parametrize("image", ["ddpflow:latest", "registry.example/org/ddpflow:1.0",
                                   "localhost:5000/a/b:2.4.0-cuda12.1",
                                   "registry.example:443/vendor/x:24.05-py3",
                                   "ddpflow@sha256:" + "a" * 64])
def test_image_references_the_engines_take_are_accepted(tmp_path, image):
    cfg = from_dict(tiny_config(tmp_path, container={"image": image, "base_image": image}))
    assert cfg.container.image == image


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_an_engine_that_does_not_answer_is_one_message(tmp_path, monkeypatch, engine):
    """DOCKER_HOST at a socket that does not exist: the engine, the socket and what to do."""
    from ddpflow.launch import container

    sock = tmp_path / "no" / f"{engine}.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
    with pytest.raises(UserError) as e:
        container.client(engine)
    text = str(e.value)
    assert f"container.engine is '{engine}'" in text and f"unix://{sock}" in text, text
    assert "the socket does not exist" in text and "DOCKER_HOST" in text, text
    assert "start" in text and "container.engine: none" in text, text
    assert "Traceback" not in text and "\n" not in text


def test_podman_without_its_socket_names_the_sockets_tried(tmp_path, monkeypatch):
    from ddpflow.launch import container

    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(container, "PODMAN_SOCKETS", (str(tmp_path / "sys/podman.sock"),))
    with pytest.raises(UserError) as e:
        container.client("podman")
    text = str(e.value)
    assert f"unix://{tmp_path}/run/podman/podman.sock or unix://{tmp_path}/sys/podman.sock" \
        in text and "none of these sockets exists" in text, text
    assert "podman system service" in text


def test_apptainer_not_installed_is_one_message_and_nothing_written(tmp_path, monkeypatch):
    from ddpflow.launch import container

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cfg = from_dict(tiny_config(tmp_path, container={"engine": "apptainer",
                                                     "uri": "docker://org/ddpflow:1.0"}))
    out = tmp_path / "run" / "image.json"
    with pytest.raises(UserError, match="container.engine is 'apptainer', but apptainer is "
                                        "not installed; install it, or set container.engine"):
        container.build(cfg, REPO, out)
    assert not out.parent.exists()


# --------------------------------------------------------------------------- real processes

# `ddpflow <args>` with one function wrapped: it prints `marker` and waits for a line on
# stdin before it goes on (a point the test controls, inside the real command)
PAUSED = """
import importlib, sys
module, name, marker = sys.argv[1:4]
mod = importlib.import_module(module)
real = getattr(mod, name)
def paused(*a, **k):
    if marker in str(a[0]) or marker == "*":
        print("paused", flush=True)
        sys.stdin.readline()
    return real(*a, **k)
setattr(mod, name, paused)
from ddpflow.cli import entry
sys.argv = ["ddpflow", *sys.argv[4:]]
raise SystemExit(entry())
"""


def _paused(module: str, name: str, marker: str, *args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", PAUSED, module, name, marker,
                             *map(str, args)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    assert line.strip() == "paused", (line, proc.poll(), proc.stderr.read() if
                                      proc.poll() is not None else "")
    return proc


LEADERBOARD = ("headline.txt", "leaderboard.csv", "leaderboard.json", "report.html")


def test_sigkill_while_the_leaderboard_is_written_leaves_nothing_that_looks_complete(tmp_path):
    cfg = tiny_config(tmp_path, sweep={"grid": {"stages.0.lr": [0.05, 0.1]}},
                      hardware={"device": "cpu"})
    path = write_config(tmp_path, cfg)
    ddpflow("sweep", "plan", "--config", path, check=True)
    out = tmp_path / "results/t/sweep"
    ddpflow("sweep", "collect", "--config", path, check=True)
    first = json.loads((out / "leaderboard.json").read_text())
    assert all(t["status"] == "not finished" for t in first["trials"])
    # one trial now has a summary (minimal, passes SUMMARY_SCHEMA): the next board differs
    plan = json.loads((out / "plan.json").read_text())
    trial = from_dict(json.loads(Path(plan["trials"][0]["config"]).read_text()))
    stage = trial.stage_dir(trial.stages[0].name)
    stage.mkdir(parents=True)
    (stage / "summary.json").write_text(json.dumps({
        "finished": True, "steps": 8, "wall_time_s": 1.5, "world_size": 1,
        "monitor": "val_loss", "best_value": 0.5}))
    proc = _paused("ddpflow.sweeps.leaderboard", "write_json_atomic", "leaderboard.json",
                   "sweep", "collect", "--config", path)
    try:  # killed after the new leaderboard.csv, before leaderboard.json is written
        assert (out / "leaderboard.csv").is_file()
        proc.kill()
        proc.wait(30)
    finally:
        proc.kill()
    assert proc.returncode == -9
    for name in ("headline.txt", "leaderboard.json", "report.html"):
        assert not (out / name).exists(), name  # no old file beside the new csv
    assert not list(out.glob(".*tmp*")) and not list(out.glob("*.tmp"))
    proc = ddpflow("sweep", "collect", "--config", path, check=True)
    assert all((out / n).is_file() for n in LEADERBOARD)
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["trials"] != first["trials"]
    assert (out / "headline.txt").read_text() == proc.stdout


def test_two_prepares_of_one_folder_at_once_one_builds_the_other_names_it(tmp_path):
    cfg = tiny_config(tmp_path, data={"train_size": 64, "val_size": 16, "test_size": 16,
                                      "prepared_dir": str(tmp_path / "prep dir")})
    path = write_config(tmp_path, cfg)
    first = _paused("ddpflow.data.prepare", "_build", "*", "prepare", "--config", path)
    try:  # the first holds the folder's lock, in the middle of its build
        second = ddpflow("prepare", "--config", path)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        assert f"pid {first.pid}" in second.stderr and "prep dir" in second.stderr
        assert not (tmp_path / "prep dir" / "meta.json").exists()
        stdout, stderr = first.communicate("go\n", timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and "prepared synthetic" in stdout, stderr
    meta = json.loads((tmp_path / "prep dir" / "meta.json").read_text())
    assert meta["counts"]["train"]["total"] == 64
    # complete: the same command finds it up to date, every array checked
    again = ddpflow("prepare", "--config", path, "--verify", check=True)
    assert "is up to date" in again.stdout, again.stdout
    assert not [n for n in os.listdir(tmp_path) if n.startswith("prep dir") and n != "prep dir"
                and not n.endswith(".lock")]


def test_the_leaderboard_says_how_to_export_and_predict_the_best_trial(tmp_path):
    """The headline names the best trial's own config and `--weights best`: the commands
    read back word for word, whatever the folder names hold."""
    import shlex

    from ddpflow.sweeps.leaderboard import headline

    cfg = from_dict(tiny_config(tmp_path / "odd $(x) dir"))
    conf = str(tmp_path / "odd $(x) dir" / "t" / "trials" / "lr-0.1" / "trial_config.json")
    best = {"trial": "lr-0.1", "monitor": "val_acc", "best_value": 0.9, "status": "finished",
            "weights": "best.pt", "config": conf, "best": True}
    out = tmp_path / "sweep"
    lines = headline(cfg, [best], best, out).splitlines()
    export = next(ln for ln in lines if "export it:" in ln).split("export it:", 1)[1]
    assert shlex.split(export) == ["ddpflow", "export", "--config", conf, "--weights", "best",
                                   "--out", str(out / "best-lr-0.1")]
    then = next(ln for ln in lines if "then:" in ln).split("then:", 1)[1]
    assert shlex.split(then)[:4] == ["ddpflow", "predict", "--bundle", str(out / "best-lr-0.1")]

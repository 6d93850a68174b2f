# Small helpers shared by the files under rules/ (paths, the config file every `ddpflow` call
# reads; what a changed setting reruns is ddpflow's own rule, HASHES from `validate --json`).
import json
import os
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

# every value on a shell line built here is quoted by ddpflow's one quoting module (the
# rules' `shell:` lines use `{x:q}`); the workflow imports nothing else of the library
from ddpflow.core.quoting import format_literal, shell_line, shell_word

# rules call `ddpflow` from the rule's environment (conda, container) when it has one, else
# from the Python that runs Snakemake: `.venv/bin/snakemake` works without activating .venv
# (shell.prefix formats its text like shell(): format_literal keeps a `{` in the path)
shell.prefix(
    format_literal(
        "command -v ddpflow >/dev/null || export PATH="
        + shell_word(Path(sys.executable).parent)
        + ":$PATH; "
    )
)


def ddpflow_stdin(*args):
    """Run `ddpflow <args> --config -` with the config on stdin at parse time; a config the
    library rejects stops the workflow here with its one-line message, before any job.
    """
    ddpflow = [shutil.which("ddpflow")] if shutil.which("ddpflow") else []
    ddpflow = ddpflow or [sys.executable, "-m", "ddpflow"]
    r = subprocess.run(
        [*ddpflow, *args, "--config", "-"],
        input=json.dumps(config),
        capture_output=True,
        text=True,
    )
    if r.returncode:
        sys.exit(r.stderr.strip() or f"ddpflow {args[0]} failed ({r.returncode})")
    return r


def profile_partition():
    """The partition the profile's default-resources give every job (what `slurm.partition:
    null` means), or None (a local run, or a value that is not a plain partition name).
    """
    words = getattr(workflow.resource_settings.default_resources, "args", None) or ()
    for word in words:
        name, _, value = str(word).partition("=")
        value = value.strip().strip("'\"")
        if name.strip() == "slurm_partition" and re.fullmatch(r"[\w.,-]+", value):
            return value
    return None


# training jobs go to the profile's partition unless the config names one: say so in the
# config, so that the Slurm sizes it leaves open (slurm.cpus_per_gpu, slurm.mem_mb) are a
# share of a node of that partition
if not (config.get("slurm") or {}).get("partition") and profile_partition():
    config["slurm"] = {**(config.get("slurm") or {}), "partition": profile_partition()}
# the config as the library resolves it: the checks a schema cannot make (slurm.gres against
# slurm.gpus, the tracking and container URIs, Slurm sizes against the partition's nodes)
# and the values it fills in (slurm.gpus, slurm.cpus_per_gpu and slurm.mem_mb from sinfo)
# and what each result depends on: the one rerun rule (config/rerun.py) as each rule's params
_resolved = json.loads(ddpflow_stdin("validate", "--json").stdout)
config.update(_resolved["config"])
HASHES = _resolved["hashes"]


RUN = config["run"]
RESULTS = f"{config['results_dir']}/{RUN}"
# a run's job logs live with its results (not in the folder snakemake runs in)
LOGS = f"{RESULTS}/logs"
STAGES = [s["name"] for s in config["stages"]]
PACKAGE = Path(workflow.basedir) / "src" / "ddpflow"
# the image of every rule that runs ddpflow's work, for `--sdm apptainer`; only with engine
# none (the docker/podman/apptainer engines run the container from inside the rule)
CONTAINER = (
    config["container"]["uri"] if config["container"]["engine"] == "none" else None
)
STAGE_PATTERN = "|".join(re.escape(s) for s in STAGES)


def workflow_config():
    """The validated config (defaults filled) as the one file every ddpflow call reads."""
    path = Path(RESULTS) / "workflow_config.json"
    text = json.dumps(config, indent=2, sort_keys=True)
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(path)


def sweep_plan():
    """A sweep's trials (`ddpflow sweep plan`): every trial is checked before any job runs,
    and a bad one stops the workflow here, before anything is written."""
    sw = config.get("sweep") or {}
    if not (sw.get("grid") or sw.get("variants") or sw.get("random")):
        return None
    print(ddpflow_stdin("sweep", "plan").stderr.strip(), file=sys.stderr)
    return json.loads((Path(RESULTS) / "sweep" / "plan.json").read_text())


PLAN = sweep_plan()
SWEEP = PLAN is not None
# sweep.scheduler asha / sweep.search tpe: one scheduler job runs the trials (sweep.smk)
SCHEDULED = SWEEP and (
    config["sweep"]["scheduler"] != "none" or config["sweep"]["search"] != "none"
)
WCFG = workflow_config()
# evaluate and export need a classifier on prepared images (not a data.source python
# dataset read as it is, nor a regression task): the last stage's test split and bundle
HELD_OUT = config["task"]["name"] == "classification" and (
    config["data"]["source"] != "python" or config["data"]["materialize"]
)


def files_version(files, root=None):
    """Hash of files' names and bytes."""
    h = hashlib.sha256()
    for f in files:
        if root is not None:
            h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def code_version(*parts):
    """Hash of the package source (or some of its modules): the rerun trigger for code."""
    files = sorted(f for p in parts or ("",) for f in (PACKAGE / p).glob("**/*.py"))
    return files_version(files + [PACKAGE / "schema" / "config.schema.yaml"])


def user_code_version(folder):
    """Hash of a user's code folder (model.code_dir, data.code_dir): editing a file there
    reruns the rules that use it, and only those."""
    if not folder or not Path(folder).is_dir():
        return ""
    root = Path(folder)
    files = sorted(
        f
        for f in root.rglob("*.py")
        if not any(
            p.startswith(".") or p == "__pycache__" for p in f.relative_to(root).parts
        )
    )
    return files_version(files, root)


def data_user_code(cfg=config):
    """The dataset factory's code folder (data.code_dir, else model.code_dir)."""
    d = cfg["data"]
    if d["source"] != "python":
        return ""
    return user_code_version(d["code_dir"] or cfg["model"]["code_dir"])


def stage_inputs(wildcards):
    return inputs_of_stage(
        config, wildcards.stage, RESULTS, f"{RESULTS}/data/meta.json"
    )


def inputs_of_stage(cfg, stage, results, data_meta):
    """A stage's input files: prepared data, image record, tuning, the weights it starts from."""
    names = [s["name"] for s in cfg["stages"]]
    i = names.index(stage)
    init = cfg["stages"][i]["init_from"]
    inputs = {"data": data_meta, "image": f"{results}/image.json"}
    if cfg["tune"]["enabled"]:
        inputs["tune"] = f"{results}/tune.json"
    if init == "previous":
        inputs["init"] = f"{results}/stages/{names[i - 1]}/final.pt"
    elif init:
        inputs["init"] = init
    elif cfg["model"]["weights"] and Path(cfg["model"]["weights"]).is_file():
        inputs["init"] = cfg["model"]["weights"]  # pretrained weights (a file)
    return inputs


def slurm_resources(cfg=config):
    """Resources the Slurm executor turns into sbatch options (ignored by --cores)."""
    s = cfg["slurm"]
    # the executor pastes slurm_extra into its sbatch line (a shell runs it): one quoted
    # word per option (config validation took slurm.extra only as plain words, see
    # docs/slurm.md), never one word of all of them
    extra = [f"--signal=USR1@{s['signal_before_end_s']}", *s["extra"].split()]
    res = {
        "mem_mb": s["mem_mb"],
        "runtime": s["runtime_min"],
        "slurm_extra": shell_line(extra),
    }
    if s["gpus"] > 0:
        # one task that keeps all the job's GPUs (torchrun starts the ranks): no
        # --ntasks-per-gpu, which would run the job once per GPU with one GPU each
        res.update(cpus_per_gpu=s["cpus_per_gpu"], tasks_per_gpu=0)
        if s["gres"]:  # clusters that only accept --gres (gpus is its count, resolved)
            res["gres"] = s["gres"]
        else:
            res["gpu"] = s["gpus"]
        if s["gpu_model"]:
            res["gpu_model"] = s["gpu_model"]
    else:
        res["cpus_per_task"] = s["cpus"]
    nodes = cfg["hardware"]["nodes"]
    if nodes > 1:
        # one torchrun per node, started by ddpflow's own `srun` as the job's step: mpi
        # stops the jobstep plugin from wrapping the job in `srun -n1`
        res.update(nodes=nodes, tasks=nodes, mpi="srun")
    for key in ("partition", "account"):
        if s[key]:
            res[f"slurm_{key}"] = s[key]
    return res


def slurm_preflight():
    """Under the Slurm executor, once before anything is submitted: `sbatch --test-only`
    with each distinct request of the jobs to run, as the executor's own sbatch line builder
    makes it. A request Slurm refuses (more than any node has, an unknown account or
    partition) stops the workflow here with sbatch's reason, once; submitted, the refusal
    would count as a failed job and come back with every retry of the profile."""
    plugin = getattr(workflow, "executor_plugin", None)
    if getattr(plugin, "name", None) != "slurm":
        return
    try:  # the plugin's own builders (2.7.1 .. 2.8 keep them here)
        from snakemake_executor_plugin_slurm.submit_string import get_submit_command
        from snakemake_executor_plugin_slurm.utils import set_gres_string
    except ImportError:
        print("ddpflow: note: no Slurm pre-flight check", file=sys.stderr)
        return

    calls = {}
    for job in workflow.dag.needrun_jobs():
        if job.is_local or job.is_group():
            continue
        r = job.resources
        params = {
            "run_uuid": "ddpflow-preflight",
            "slurm_logfile": os.devnull,
            "comment_str": "ddpflow-preflight",  # one check per distinct request
            "account": (
                f"-A {shell_word(r['slurm_account'])}" if r.get("slurm_account") else ""
            ),
            "partition": (
                f"-p {shell_word(r['slurm_partition'])}"
                if r.get("slurm_partition")
                else ""
            ),
            "workdir": None,
        }
        try:
            call = get_submit_command(job, params, settings=workflow.executor_settings)
        except TypeError:  # plugins before 2.8 take no settings
            call = get_submit_command(job, params)
        call += set_gres_string(job)
        calls.setdefault(
            call.replace("sbatch --parsable", "sbatch --test-only", 1), job
        )
    for call, job in calls.items():
        r = subprocess.run(
            f"{call} --wrap=true", shell=True, capture_output=True, text=True
        )
        if r.returncode:
            lines = [l.strip() for l in r.stderr.splitlines() if l.strip()]
            # what it asks for: the words after the name, log and comment
            asked = call.split(" --comment ")[1].split(" ", 1)[1]
            sys.exit(
                f"ddpflow: Slurm refuses the jobs of rule "  # (one line would read as
                f"{job.rule.name}: "  # a rule to `snakemake --lint`)
                f"{'; '.join(lines) or f'sbatch exit {r.returncode}'}. Nothing was "
                f"submitted. They ask for: {asked}. Check the partition, the account and "
                f"the sizes in the config's slurm: section (docs/slurm.md, 'What to "
                f"size'; sinfo -N -o '%P %N %c %m %G' lists the nodes)"
            )


def on_start():
    """Snakefile's onstart: the Slurm pre-flight check; for a sweep, `--keep-going`: one
    failed trial does not stop the others (the Slurm profile sets it; Snakemake has no
    public way for a Snakefile to, so this sets the scheduler's flag where Snakemake 9
    keeps it). The leaderboard lists failed trials with their reason."""
    if SWEEP and hasattr(getattr(workflow, "scheduler", None), "keepgoing"):
        workflow.scheduler.keepgoing = True
    slurm_preflight()


def image_inputs():
    if config["container"]["engine"] == "none":
        return []
    top = Path(workflow.basedir)
    files = [top / "Dockerfile", top / "pyproject.toml", *PACKAGE.glob("**/*.py")]
    return sorted(str(p) for p in files)


def data_inputs(cfg=config):
    path = cfg["data"]["path"]
    return [path] if path and Path(path).is_file() else []


def data_listing(cfg=config):
    """Names, sizes and modification times of a data folder's files: an image added,
    removed or replaced reruns the preparation (a folder's own mtime misses those)."""
    path = cfg["data"]["path"]
    if not path or not Path(path).is_dir():
        return ""
    h = hashlib.sha256()
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(path)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


# --- sweeps (rules in sweep.smk): trial id -> plan entry and config
TRIALS = {t["id"]: t for t in PLAN["trials"]} if SWEEP else {}
TCFG = {i: json.loads(Path(t["config"]).read_text()) for i, t in TRIALS.items()}


def schedule_via():
    """Where the sweep's scheduler sends its trials: sbatch under the Slurm executor (known
    once the DAG is built, when params are evaluated), else this node's slots."""
    plugin = getattr(workflow, "executor_plugin", None)
    return "slurm" if getattr(plugin, "name", None) == "slurm" else "node"


def trial_stage_inputs(wildcards):
    t = TRIALS[wildcards.trial]
    return inputs_of_stage(
        TCFG[wildcards.trial],
        wildcards.stage,
        f"{RESULTS}/trials/{wildcards.trial}",
        f"{t['prepared_dir']}/meta.json",
    )


def trial_summaries(wildcards):
    t = TRIALS[wildcards.trial]
    return [f"{RESULTS}/trials/{t['id']}/stages/{s}/summary.json" for s in t["stages"]]

"""`slurm.extra` read as sbatch reads it, against a list of the options a user may add.

sbatch parses its options with getopt_long: a long option may be abbreviated to any prefix
that names one option alone (`--partiti=pair` is `--partition=pair`), takes its value after
`=` or as the next word (`--partition pair`), an optional value only after `=`; short
options are `-p pair`, `-ppair`, and flags bundle (`-Hk`). A word that is no option ends the
options: sbatch takes it as the job script. So a list of forbidden whole names was passed by
`--partiti=pair --outp=x.log --chd=.`, and options that change what the job is (`--wrap=true`
runs `true` instead of the stage, `--array=1-100` runs it 100 times, `--hold` never starts
it) were not on it. Here every word is resolved to the option sbatch would take, and only the
options of ALLOWED pass; every other one is one message naming it (as written and as sbatch
reads it) and the key that sets it, or why the workflow cannot take it.

OPTIONS is the option table of sbatch 22.05 (name, `=` a value, `[=]` an optional one, `/x`
its short form). An option of a newer sbatch that is not in it is refused as unknown, which
is safe: a user can ask for it to be added.
"""

from __future__ import annotations

OPTIONS = """
account=/A acctg-freq= array=/a batch= begin=/b bb= bbf= cluster-constraint= chdir=/D
cluster= clusters=/M comment= container= context= contiguous constraint=/C core-spec=/S
cores-per-socket= cpu-freq= cpus-per-gpu= cpus-per-task=/c deadline= delay-boot=
dependency=/d distribution=/m error=/e exclude=/x exclusive[=] export= export-file=
extra-node-info=/B get-user-env[=] gid= gpu-bind= gpu-freq= gpus=/G gpus-per-node=
gpus-per-socket= gpus-per-task= gres= gres-flags= help/h hint= hold/H ignore-pbs input=/i
job-name=/J kill-on-invalid-dep= licenses=/L mail-type= mail-user= mcs-label= mem=
mem-bind= mem-per-cpu= mem-per-gpu= mincpus= network= nice[=] no-kill[=]/k no-requeue
nodefile=/F nodelist=/w nodes=/N ntasks=/n ntasks-per-core= ntasks-per-gpu=
ntasks-per-node= ntasks-per-socket= ntasks-per-tres= open-mode= output=/o overcommit/O
oversubscribe/s parsable partition=/p power= prefer= priority= profile= propagate[=]
qos=/q quiet/Q reboot requeue reservation= signal= sockets-per-node= spread-job switches=
tasks-per-node= test-only thread-spec= threads-per-core= time=/t time-min= tmp= uid=
use-min-nodes verbose/v version/V usage wait/W wait-all-nodes= wckey= wrap=
"""

NONE, REQUIRED, OPTIONAL = 0, 1, 2


def _table() -> tuple[dict[str, int], dict[str, str]]:
    """({long name: NONE|REQUIRED|OPTIONAL}, {short letter: long name})."""
    long, short = {}, {}
    for entry in OPTIONS.split():
        spec, _, letter = entry.partition("/")
        arg = OPTIONAL if spec.endswith("[=]") else REQUIRED if spec.endswith("=") else NONE
        name = spec.removesuffix("[=]").removesuffix("=")
        long[name] = arg
        if letter:
            short[letter] = name
    return long, short


LONG, SHORT = _table()

# what a user may add: where jobs run and how the node is shared, mail, accounting,
# priority, requeueing, bindings and frequencies, and a per-node GPU request where a site
# wants one beside the job's total (docs/slurm.md); nothing else that sizes, names, places
# or starts the job: ddpflow and the executor set those
ALLOWED = frozenset("""
acctg-freq batch bb bbf cluster-constraint context contiguous core-spec
cores-per-socket cpu-freq deadline delay-boot distribution exclude exclusive extra-node-info
gpu-bind gpu-freq gpus-per-node gres-flags hint ignore-pbs licenses mail-type mail-user
mcs-label mem-bind
network nice no-kill no-requeue nodefile nodelist overcommit oversubscribe power prefer
priority profile propagate reboot requeue reservation sockets-per-node spread-job
switches thread-spec threads-per-core tmp use-min-nodes verbose wckey
""".split())

_GPUS = "set slurm.gpus (and slurm.gres or slurm.gpu_model) instead"
_TASKS = ("one task per node runs torchrun, which starts the ranks: set hardware.nodes and "
          "hardware.nproc_per_node instead")
_LOG = ("the Slurm executor sends the job's output to its own log, and ddpflow's rule writes "
        "the stage's log: leave it out")
_EXECUTOR = "the Slurm executor sets it (a per-rule resource: snakemake --set-resources)"
_EXITS = "sbatch would print and exit, submitting no job: leave it out"
# every other option, and what to do instead
MANAGED = {
    "account": "set slurm.account instead", "partition": "set slurm.partition instead",
    **dict.fromkeys(("gpus", "gpus-per-socket", "gpus-per-task", "gres"), _GPUS),
    "cpus-per-gpu": "set slurm.cpus_per_gpu instead",
    **dict.fromkeys(("cpus-per-task", "mincpus"),
                    "set slurm.cpus (a job without GPUs) or slurm.cpus_per_gpu instead"),
    **dict.fromkeys(("mem", "mem-per-cpu", "mem-per-gpu"), "set slurm.mem_mb instead"),
    **dict.fromkeys(("time", "time-min"), "set slurm.runtime_min instead"),
    "signal": "set slurm.signal_before_end_s instead",
    **dict.fromkeys(("nodes", "ntasks", "ntasks-per-node", "tasks-per-node", "ntasks-per-core",
                     "ntasks-per-socket", "ntasks-per-tres", "ntasks-per-gpu"), _TASKS),
    **dict.fromkeys(("output", "error", "input", "open-mode"), _LOG),
    "array": ("an array job would run the stage as many times at once; to run variants, use "
              "a sweep (sweep: in the config)"),
    "wrap": "the executor's job script runs the stage; --wrap would run another command",
    "hold": "a held job never starts, and the workflow would wait for it forever",
    "begin": ("a job that may not start before a later time keeps the workflow waiting as "
              "a held job does: start the workflow at that time instead"),
    "quiet": ("sbatch would not print the job's id, which the Slurm executor reads to follow "
              "the job: leave it out"),
    **dict.fromkeys(("dependency", "kill-on-invalid-dep"),
                    "Snakemake orders the jobs by their inputs and outputs itself"),
    "test-only": ("the workflow already puts every request to sbatch --test-only at its "
                  "start; with it in every job, no job would ever be submitted"),
    "wait": "sbatch would block until the job ends, and the executor with it: leave it out",
    **dict.fromkeys(("uid", "gid"), "it runs the job as another user (root only): leave it out"),
    "container": "ddpflow's container: section runs the stage in a container; set that instead",
    **dict.fromkeys(("parsable", "job-name", "comment", "chdir", "export", "export-file",
                     "get-user-env", "clusters", "cluster", "qos", "constraint",
                     "wait-all-nodes"), _EXECUTOR),
    **dict.fromkeys(("help", "usage", "version"), _EXITS),
}


def resolve(word: str) -> tuple[str | None, str | None]:
    """(the long option sbatch takes `--word...` (without the dashes and value) for, or
    None; why not, or None)."""
    name = word.partition("=")[0]
    if name in LONG:
        return name, None
    found = sorted(n for n in LONG if n.startswith(name))
    if not found:
        return None, "is not an sbatch option"
    if len(found) > 1:
        return None, (f"is ambiguous to sbatch (it could be --{', --'.join(found[:4])}"
                      + (" ..." if len(found) > 4 else "") + "): write the whole option")
    return found[0], None


def options(extra: str) -> list[tuple[str, str]] | str:
    """slurm.extra's words as sbatch parses them: [(written, long option)], or the problem
    (one sentence naming the word)."""
    words, out = iter(extra.split()), []
    for w in words:
        if w == "--" or not w.startswith("-") or w == "-":
            return (f"has {w!r}, which is no option: sbatch would take it (and every word "
                    f"after it) as the job's script")
        if w.startswith("--"):
            name, why = resolve(w[2:])
            if why:
                return f"has {w.partition('=')[0]}, which {why}"
            arg, has_value = LONG[name], "=" in w
            if arg == NONE and has_value:
                return f"has {w}, but --{name} takes no value"
            # the next word is its value (split() words are never empty: None is the end)
            if arg == REQUIRED and not has_value and next(words, None) is None:
                return f"ends with {w}, which needs a value"
            out.append((w.partition("=")[0], name))
            continue
        for j in range(1, len(w)):  # -vN: flags bundled, the first that takes a value ends it
            name = SHORT.get(w[j])
            if name is None:
                return f"has -{w[j]} (in {w}), which is not an sbatch option"
            out.append((f"-{w[j]}", name))
            if LONG[name] != NONE:  # the rest of the word, or the next word, is its value
                if LONG[name] == REQUIRED and j + 1 == len(w) and next(words, None) is None:
                    return f"ends with {w}, which needs a value"
                break
    return out


def extra_problem(extra: str) -> str | None:
    """Why slurm.extra cannot go to sbatch (the first word that cannot), or None."""
    parsed = options(extra)
    if isinstance(parsed, str):
        return parsed
    for written, name in parsed:
        if name in ALLOWED:
            continue
        read = "" if written == f"--{name}" else f" (sbatch reads {written} as --{name})"
        return f"sets --{name}{read}, which slurm.extra may not set: {MANAGED[name]}"
    return None

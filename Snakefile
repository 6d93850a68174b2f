# ddpflow: build the image, prepare the data, train stage after stage with torchrun,
# collect the results.   snakemake --cores all   |   snakemake --profile profiles/slurm
from snakemake.utils import min_version

min_version("9.0")


# the embedded default, only when no --configfile is given: a user's config is never
# merged with it (keys the user leaves out take the schema's defaults, as in the CLI)
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


# common.smk resolves the config through ddpflow's own validation against
# workflow/schemas/config.schema.yaml (one clear message for any mistake, before any job),
# once: it also gives each rule what its result depends on (ddpflow's rerun rule)
include: "workflow/rules/common.smk"
include: "workflow/rules/image.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/tune.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/collect.smk"
include: "workflow/rules/sweep.smk"


onstart:
    on_start()  # common.smk: the Slurm pre-flight check, --keep-going for a sweep


rule all:
    default_target: True
    input:
        rules.sweep_leaderboard.output if SWEEP else rules.collect.output,

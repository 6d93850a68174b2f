# Sweeps (sweep.grid, sweep.variants, sweep.random): every trial is a whole run under
# results/<run>/trials/<id>/ with its own config (written by `ddpflow sweep plan`, see
# common.smk). Trials with equal data settings share one prepared dataset; trials run side
# by side, each in its own slot of the node (`ddpflow launch` picks the GPUs or cores:
# Snakemake only counts them). After all trials, one leaderboard.
# With sweep.scheduler asha or sweep.search tpe, which trial trains next depends on results
# as they come, so one job (sweep_schedule) decides and hands each trial's next rung to the
# node's slots or to sbatch; the DAG has no job per trial.

if SWEEP and not SCHEDULED:
    DATASETS = {Path(t["prepared_dir"]).name: t for t in reversed(PLAN["trials"])}
    TRIAL_PATTERN = "|".join(re.escape(i) for i in TRIALS)
    TRIAL_STAGES = "|".join(
        sorted({re.escape(s) for t in PLAN["trials"] for s in t["stages"]})
    )
    FIRST = TCFG[PLAN["trials"][0]["id"]]  # Slurm resources: the same for every trial

    rule sweep_prepare_data:
        input:
            lambda w: data_inputs(TCFG[DATASETS[w.dataset]["id"]]),
        output:
            f"{RESULTS}/sweep/data/{{dataset}}/meta.json",
        log:
            f"{LOGS}/sweep/prepare_data_{{dataset}}.log",
        wildcard_constraints:
            dataset="[0-9a-f]+",
        conda:
            "../envs/ddpflow.yaml"
        container:
            CONTAINER
        params:
            cfg=lambda w: DATASETS[w.dataset]["config"],
            files=lambda w: data_listing(TCFG[DATASETS[w.dataset]["id"]]),
            code=code_version("data"),
            user_code=lambda w: data_user_code(TCFG[DATASETS[w.dataset]["id"]]),
        shell:
            "ddpflow --log={log:q} prepare --config={params.cfg:q}"

    localrules:
        sweep_image,
        sweep_collect_trial,

    rule sweep_image:
        input:
            f"{RESULTS}/image.json",
        output:
            f"{RESULTS}/trials/{{trial}}/image.json",
        wildcard_constraints:
            trial=TRIAL_PATTERN,
        priority: 10  # right before its trial's training, not after other trials' collects
        shell:
            "cp -- {input:q} {output:q}"

    rule sweep_tune:
        input:
            data=lambda w: f"{TRIALS[w.trial]['prepared_dir']}/meta.json",
            image=f"{RESULTS}/trials/{{trial}}/image.json",
        output:
            f"{RESULTS}/trials/{{trial}}/tune.json",
        log:
            f"{LOGS}/trials/{{trial}}/tune.log",
        wildcard_constraints:
            trial=TRIAL_PATTERN,
        priority: 10
        conda:
            "../envs/ddpflow.yaml"
        container:
            CONTAINER
        threads: config["sweep"]["threads_per_trial"]
        resources:
            **slurm_resources(FIRST),
        params:
            cfg=lambda w: TRIALS[w.trial]["config"],
            settings=lambda w: TRIALS[w.trial]["hashes"]["stages"][
                TCFG[w.trial]["tune"]["stage"] or TRIALS[w.trial]["stages"][0]
            ],
            tune=lambda w: TCFG[w.trial]["tune"],
            code=code_version(),
        shell:
            "ddpflow --log={log:q} tune --config={params.cfg:q}"

    rule sweep_train:
        input:
            unpack(trial_stage_inputs),
        output:
            final=f"{RESULTS}/trials/{{trial}}/stages/{{stage}}/final.pt",
            summary=f"{RESULTS}/trials/{{trial}}/stages/{{stage}}/summary.json",
        log:
            f"{LOGS}/trials/{{trial}}/train_{{stage}}.log",
        wildcard_constraints:
            trial=TRIAL_PATTERN,
            stage=TRIAL_STAGES,
        # a freed slot goes to the next trial before any per-trial collect: no idle GPU
        # while trials wait
        priority: 10
        conda:
            "../envs/ddpflow.yaml"
        container:
            CONTAINER
        threads: config["sweep"]["threads_per_trial"]
        resources:
            **slurm_resources(FIRST),
        params:
            cfg=lambda w: TRIALS[w.trial]["config"],
            settings=lambda w: TRIALS[w.trial]["hashes"]["stages"][w.stage],
            code=code_version(),
            user_code=lambda w: user_code_version(TCFG[w.trial]["model"]["code_dir"]),
            data_code=lambda w: data_user_code(TCFG[w.trial]),
        shell:
            "ddpflow --log={log:q} launch --config={params.cfg:q} --stage {wildcards.stage:q}"

    rule sweep_collect_trial:
        input:
            trial_summaries,
            image=f"{RESULTS}/trials/{{trial}}/image.json",
        output:
            f"{RESULTS}/trials/{{trial}}/summary/summary.json",
        log:
            f"{LOGS}/trials/{{trial}}/collect.log",
        wildcard_constraints:
            trial=TRIAL_PATTERN,
        conda:
            "../envs/ddpflow.yaml"
        params:
            cfg=lambda w: TRIALS[w.trial]["config"],
        shell:
            "ddpflow --log={log:q} collect --config={params.cfg:q}"


if SCHEDULED:

    localrules:
        sweep_schedule,

    # a local job under Slurm too: it waits while its sbatch jobs train (runner.py)
    rule sweep_schedule:
        input:
            plan=f"{RESULTS}/sweep/plan.json",
            image=f"{RESULTS}/image.json",
        output:
            f"{RESULTS}/sweep/schedule/done.json",
        log:
            f"{LOGS}/sweep/schedule.log",
        conda:
            "../envs/ddpflow.yaml"
        params:
            cfg=WCFG,
            logs=f"{LOGS}/trials",
            via=lambda w: schedule_via(),
            settings=HASHES["config"],  # the whole config less what no result depends on
            code=code_version(),
            user_code=user_code_version(config["model"]["code_dir"]),
            data_code=data_user_code(),
        shell:
            "ddpflow --log={log:q} sweep schedule --config={params.cfg:q} "
            "--logs={params.logs:q} --via={params.via:q}"


if SWEEP:

    localrules:
        sweep_leaderboard,

    rule sweep_leaderboard:
        input:
            (
                f"{RESULTS}/sweep/schedule/done.json"
                if SCHEDULED
                else expand(
                    f"{RESULTS}/trials/{{trial}}/summary/summary.json", trial=TRIALS
                )
            ),
            plan=f"{RESULTS}/sweep/plan.json",
        output:
            csv=report(
                f"{RESULTS}/sweep/leaderboard.csv",
                caption="../report/leaderboard.rst",
                category="Sweep",
            ),
            json=f"{RESULTS}/sweep/leaderboard.json",
            html=f"{RESULTS}/sweep/report.html",
            headline=f"{RESULTS}/sweep/headline.txt",
        log:
            f"{LOGS}/sweep/leaderboard.log",
        conda:
            "../envs/ddpflow.yaml"
        params:
            cfg=WCFG,
            logs=f"{LOGS}/trials",
        shell:
            "ddpflow --log={log:q} sweep collect --config={params.cfg:q} --logs={params.logs:q}"

    onerror:
        # failed trials are rows with their reason, not holes: the leaderboard is written
        # from whatever finished; every word quoted, and format_literal because shell()
        # formats its text with this file's variables
        logs = f"{LOGS}/trials"
        words = [
            "ddpflow",
            "sweep",
            "collect",
            f"--config={WCFG}",
            f"--logs={logs}",
        ]
        shell(format_literal(shell_line(words)) + " || true")

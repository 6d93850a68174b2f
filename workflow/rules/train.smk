# Training: one job per stage, each one `ddpflow launch` = one torchrun with N ranks.
# A stage reruns when what its result depends on changes (its hash from `ddpflow validate
# --json`: config/rerun.py, the rule ddpflow itself uses), the package code or the image;
# later stages follow through their inputs.


rule train:
    input:
        unpack(stage_inputs),
    output:
        final=f"{RESULTS}/stages/{{stage}}/final.pt",
        summary=f"{RESULTS}/stages/{{stage}}/summary.json",
    log:
        f"{LOGS}/train_{{stage}}.log",
    wildcard_constraints:
        stage=STAGE_PATTERN,
    conda:
        "../envs/ddpflow.yaml"
    container:
        CONTAINER
    resources:
        **slurm_resources(),
    params:
        cfg=WCFG,
        settings=lambda wildcards: HASHES["stages"][wildcards.stage],
        code=code_version(),
        user_code=user_code_version(config["model"]["code_dir"]),
        data_code=data_user_code(),
    shell:
        "ddpflow --log={log:q} launch --config={params.cfg:q} --stage {wildcards.stage:q}"

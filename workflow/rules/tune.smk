# Tuning (tune.enabled): measure the node once, before the first stage; stages with
# batch_size/precision/data.loader "auto" take the measured choice from tune.json.


rule tune:
    input:
        data=f"{RESULTS}/data/meta.json",
        image=f"{RESULTS}/image.json",
    output:
        f"{RESULTS}/tune.json",
    log:
        f"{LOGS}/tune.log",
    conda:
        "../envs/ddpflow.yaml"
    container:
        CONTAINER
    resources:
        **slurm_resources(),
    params:
        cfg=WCFG,
        settings=HASHES["stages"][config["tune"]["stage"] or STAGES[0]],
        tune=config["tune"],
        code=code_version(),
    shell:
        "ddpflow --log={log:q} tune --config={params.cfg:q}"

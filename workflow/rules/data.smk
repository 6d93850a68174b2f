# Data: the configured source, prepared once into the memory-mappable format.
rule prepare_data:
    input:
        data_inputs(),
    output:
        f"{RESULTS}/data/meta.json",
    log:
        f"{LOGS}/prepare_data.log",
    conda:
        "../envs/ddpflow.yaml"
    container:
        CONTAINER
    params:
        cfg=WCFG,
        data=HASHES["prepare"],  # what the prepared arrays depend on (config/rerun.py)
        files=data_listing(),
        code=code_version("data"),
        user_code=data_user_code(),
    shell:
        "ddpflow --log={log:q} prepare --config={params.cfg:q}"

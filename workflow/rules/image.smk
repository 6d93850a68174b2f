# The container image: rebuilt only when the Dockerfile or the package changes.


rule image:
    input:
        image_inputs(),
    output:
        f"{RESULTS}/image.json",
    log:
        f"{LOGS}/image.log",
    conda:
        "../envs/ddpflow.yaml"
    params:
        cfg=WCFG,
        container=config["container"],
        context=workflow.basedir,
    shell:
        "ddpflow --log={log:q} image --config={params.cfg:q} --context={params.context:q} --out={output:q}"

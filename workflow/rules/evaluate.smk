# Evaluate and export: the last stage's weights on the held-out test split (accuracy,
# per-class scores, confusion matrix), then a bundle (safetensors, TorchScript, ONNX,
# model.json) that `ddpflow predict` runs without the config. Both follow the last
# stage: a retrained stage re-evaluates and re-exports.


rule evaluate:
    input:
        final=f"{RESULTS}/stages/{STAGES[-1]}/final.pt",
        summary=f"{RESULTS}/stages/{STAGES[-1]}/summary.json",
        data=f"{RESULTS}/data/meta.json",
    output:
        metrics=f"{RESULTS}/evaluate/{STAGES[-1]}/test-final/metrics.json",
    log:
        f"{LOGS}/evaluate.log",
    conda:
        "../envs/ddpflow.yaml"
    resources:
        **slurm_resources(),
    params:
        cfg=WCFG,
        code=code_version(),
    shell:
        "ddpflow --log={log:q} evaluate --config={params.cfg:q} --split test --allow-empty"


rule export:
    input:
        final=f"{RESULTS}/stages/{STAGES[-1]}/final.pt",
        evaluated=rules.evaluate.output.metrics,
    output:
        bundle=f"{RESULTS}/export/model.json",
    log:
        f"{LOGS}/export.log",
    conda:
        "../envs/ddpflow.yaml"
    params:
        cfg=WCFG,
        code=code_version(),
    shell:
        "ddpflow --log={log:q} export --config={params.cfg:q}"

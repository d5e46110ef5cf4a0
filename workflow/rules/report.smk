# Tables, plots and findings from the result files (no model is loaded here).
from clusterft.pipeline.names import CLUSTER
from clusterft.plan.sweep import REPORT_PLOTS, REPORT_TABLES

# The `benchmark:` files selection_overhead reads (clusterft.analysis.overhead): the method's score,
# cluster, select and train jobs at the claim budget and the full-data train jobs beside
# them; inputs of the report so that Snakemake finishes those jobs first.
OVERHEAD_BENCHMARKS = PLAN.overhead_benchmarks(CLUSTER, CFG["report"]["claim_budget"])


rule report:
    input:
        **PLAN.report_inputs(),
        benchmarks=OVERHEAD_BENCHMARKS,
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
            for p in REPORT_PLOTS
            for d in DATASETS
        ],
        runs="results/tables/runs.csv",
        overhead=[
            report(
                f"results/tables/selection_overhead.{ext}",
                caption="../report/selection_overhead.rst",
                category="Tables",
            )
            for ext in ("csv", "md")
        ],
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
        runs=PLAN.run_records(),
        clusterings=PLAN.cluster_records(),
        labels={d: f"results/data/{d}/labels.parquet" for d in DATASETS},
        cfg=section("report"),
    script:
        "../scripts/report.py"

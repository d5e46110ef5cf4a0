# Tables, plots and findings from the result files (no model is loaded here).
from clusterft.pipeline.names import CLUSTER
from clusterft.stages.report import DEFAULTS as REPORT_DEFAULTS

# The `benchmark:` files selection_overhead reads (clusterft.analysis.overhead): the method's score,
# cluster, select and train jobs at the claim budget and the full-data train jobs beside
# them; inputs of the report so that Snakemake finishes those jobs first.
OVERHEAD_BUDGET = budget_label(
    section("report").get("claim_budget", REPORT_DEFAULTS["claim_budget"])
)
OVERHEAD_RUNS = [
    (r, {**r, "method": FULL, "budget": budget_label(1.0)})
    for r in unique(ACCURACY_RUNS + TIME_RUNS)
    if r["method"] == CLUSTER and r["budget"] == OVERHEAD_BUDGET
]
OVERHEAD_BENCHMARKS = sorted(
    {
        path
        for r, full in OVERHEAD_RUNS
        if full in ACCURACY_RUNS + TIME_RUNS
        for path in (
            train_benchmark(r),
            train_benchmark(full),
            "benchmarks/out/score/{dataset}/{model}/s{seed}.tsv".format(**r),
            "benchmarks/out/cluster/{dataset}/{model}/gradient/s{seed}.tsv".format(**r),
            "benchmarks/out/select/{dataset}/{model}/{method}-{budget}/s{seed}.tsv".format(
                **r
            ),
        )
    }
)


rule report:
    input:
        **report_inputs(),
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
            for p in ("accuracy_vs_data", "time")
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
        runs=run_records(),
        clusterings=cluster_records(),
        labels={d: f"results/data/{d}/labels.parquet" for d in DATASETS},
        cfg=section("report"),
    script:
        "../scripts/report.py"

# Tables, plots and findings from the result files (no model is loaded here).
from clusterft.pipeline.names import CLUSTER
from clusterft.plan.sweep import QUICK_DIR, REPORT_PLOTS, REPORT_TABLES

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


# The quick target (`snakemake --cores all quick`, sweep.quick): one cell's full, random,
# oracle and method runs at the claim budget. The same jobs as `all` (a later full run
# reuses them) and the same report code; its claims, findings and skill recovery go to
# results/quick. Inputs and params are functions: a config whose sweep cannot give the
# cell fails (naming sweep.quick.*) only when the target is asked for.
rule quick_report:
    input:
        unpack(JOBS.quick_inputs),
    output:
        tables=[
            f"{QUICK_DIR}/tables/{t}.{ext}"
            for t in REPORT_TABLES
            for ext in ("csv", "md")
        ],
        findings=f"{QUICK_DIR}/tables/findings.md",
        claims=f"{QUICK_DIR}/tables/claims.md",
        plots=directory(f"{QUICK_DIR}/plots"),
        runs=f"{QUICK_DIR}/tables/runs.csv",
        overhead=[
            f"{QUICK_DIR}/tables/selection_overhead.{ext}" for ext in ("csv", "md")
        ],
    log:
        "logs/quick_report.log",
    benchmark:
        "benchmarks/out/quick_report.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        runs=JOBS.quick_runs,
        clusterings=JOBS.quick_clusterings,
        labels=JOBS.quick_labels,
        cfg=section("report"),
    script:
        "../scripts/report.py"

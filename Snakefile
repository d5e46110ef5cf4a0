# cluster-ft: score -> cluster -> select -> train -> evaluate -> report.
# `snakemake --cores all` runs the embedded default (config/config.yaml);
# `snakemake --cores all --configfile config/paper.yaml` the paper's GPU-cluster setup.
from snakemake.utils import min_version

min_version("9.0")


# `--configfile X` replaces this default entirely (X must be a complete config);
# `--config key=value` overrides single keys.
if not workflow.config_settings.configfiles:

    configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/download.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/score.smk"
include: "workflow/rules/features.smk"
include: "workflow/rules/cluster.smk"
include: "workflow/rules/select.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        PLAN.report_outputs(),
        CONTAMINATION_TABLE,


# A first result in minutes: one testbed cell (sweep.quick) end to end, its claims in
# results/quick/tables/claims.md. A sub-DAG of `all`: the full run reuses every job.
rule quick:
    input:
        PLAN.quick_outputs(),

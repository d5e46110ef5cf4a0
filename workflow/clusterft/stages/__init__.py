"""The workflow's stages, one module or package per rule file of the same name
(`workflow/rules/<stage>.smk`): data, models, score, features, cluster, select, train,
evaluate, report. Each holds its rules' `run_*` functions (what the Snakemake scripts and the
`clusterft <stage>` command call) and its config section's `DEFAULTS`. A stage imports the
helper layers, never another stage: stages talk through the files one writes and the next
reads (docs/design.md, "Layers")."""

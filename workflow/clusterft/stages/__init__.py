"""The workflow's stages, one module or package per rule file of the same name
(`workflow/rules/<stage>.smk`): data, models, score, features, cluster, select, train,
evaluate, report. A stage imports shared helpers, never another stage: stages talk through
the files one writes and the next reads."""

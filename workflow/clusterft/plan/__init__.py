"""What a config asks for: loading, merging and checking it (`config`), the sweep's runs,
result paths, report inputs and jobs (`sweep`), and the rules' input and param functions
(`inputs`); pure Python, no Snakemake."""

"""What a config asks for: loading, merging and checking it (`config`) and expanding it into
the runs, result paths, report inputs and jobs of the workflow (`sweep`, for the rule files
and the cost tool). Imports the helper layers and the stages' DEFAULTS and names."""

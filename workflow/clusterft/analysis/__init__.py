"""Pure analysis over result tables, used by the report: statistics and verdicts, the
method's end-to-end overhead, and the GPU cost model of token balancing."""

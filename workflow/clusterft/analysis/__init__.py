"""Pure analysis over result tables, used by the report: statistics (`stats`) and verdicts
(`verdict`), the method's end-to-end overhead (`overhead`), and the GPU cost model of token
balancing (`costmodel`, checked against the CPU time runs in `balancecost`). Imports
`pipeline`, `modeling` and `sampler`."""

"""cluster-ft: gradient-clustered data selection and cluster-balanced data-parallel fine-tuning.

The package, one folder per layer, bottom to top; a layer imports only the layers below it
(docs/design.md, "Layers"; tests/test_structure.py checks it):

- ``pipeline/``  glue every layer may use: user errors, atomic I/O, names written once, config
  sections over DEFAULTS, provenance sidecars, pace lines, hardware, the train launcher.
- ``modeling/``  model plumbing: HF folders, tokenisation, prompt format, LoRA, optimiser,
  precision, micro-batches, the process group, checkpoints, base-model pretraining.
- ``sampler.py``  ClusterBalancedSampler, the public sampler (over ``pipeline`` only).
- ``pools/``  the pool file (``poolfile``), the built-in pool generators (``skills``,
  ``pycode``, ``icd10``, ``stdlib_snapshot``) and the overlap checks.
- ``tasks/``  the benchmark task registry and validation items as selection targets.
- ``analysis/``  statistics, verdicts and cost models over result tables, for the report.
- ``stages/``  one module or package per rule file ``workflow/rules/<stage>.smk``; each holds
  the rule's ``run_*`` function and its config section's ``DEFAULTS``; stages never import
  each other.
- ``plan/``  what a config asks for: load and check it, expand it into runs and paths.
- ``tools/``  commands over a whole config or results tree: cost, compare, configdoc.
- ``cli.py`` / ``__main__.py``  the ``clusterft`` command (``python -m clusterft <stage>``).

Where a change goes: what one rule computes, in its stage; what two stages share, in the
lowest helper layer that can hold it; which runs a config makes, in ``plan``.
"""

__version__ = "0.1.0"

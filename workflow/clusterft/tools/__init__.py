"""Tools above the workflow: the cost table before submitting (`cost`), comparing two
result trees (`compare`), and config/README.md's generated key reference (`configdoc`)."""

"""Tools above the workflow, on a whole config or results tree: the cost table before
submitting (`cost`), comparing two result trees (`compare`), and config/README.md's generated
key reference (`configdoc`). Import everything below them but `cli`."""

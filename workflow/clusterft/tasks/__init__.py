"""The benchmark tasks: the registry of the 8 tasks and their item checks (`registry`), and
their validation items as target examples for target-aware selection (`targets`). Imports
`pipeline`, `modeling` and `pools`."""

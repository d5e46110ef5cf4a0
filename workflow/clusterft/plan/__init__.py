"""What a config asks for: loading, merging and checking it (`config`)."""

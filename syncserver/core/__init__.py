"""The coordination layer: runs, members, rounds and their policies, and the read-only run view (no HTTP, no files)."""

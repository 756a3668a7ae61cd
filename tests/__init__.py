"""The test suite (a package, so that ``tests.conftest`` is imported once, under one name)."""

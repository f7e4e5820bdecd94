"""Tooling of this checkout for tests, benchmarks and examples (not installed)."""

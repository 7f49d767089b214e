"""The package version (one definition: the root package, the CLI and the benchmarks' JSON documents read it)."""

__version__ = "0.1.0"

"""The operator's tools: the command line, reports, trace replay and benchmarks."""

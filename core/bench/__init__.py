"""Benchmarks behind ``pagelm bench``: one module per benchmark (``serve``), sharing the
synthetic workload in ``workload``."""

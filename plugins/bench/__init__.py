"""Benchmarks behind ``pagelm bench``: one module per benchmark (``latency``, ``throughput``,
``serve``), sharing seeded workloads (``workload``), the memory roofline (``roofline``), the
built-in model presets (``presets``) and the Hugging Face peer (``hf_compare``)."""

"""On-device benchmarking of exported artifacts: ``edgeattn bench`` (edgeattn/cli/bench.py).

- ``runner``: every (artifact, backend) configuration in a worker process of its own, repeats round-robin;
- ``worker``: one configuration (``python -m edgeattn.bench.worker --json ...``): decode latency at each
  context, resident memory, prefill throughput, load time; bits per byte of a text;
- ``theory``: FLOPs, state and weight bytes per token, and the floor they imply on this machine;
- ``machine``: the machine's description, read bandwidth and matmul rate;
- ``presets``: fresh models of equal parameter count for ``--mixers`` (needs torch);
- ``report``, ``plots``, ``schema``: tables, results.json/.csv, PNG plots and the results schema.

Everything but ``presets`` runs on the base install (no torch).
"""

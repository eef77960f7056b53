"""Benchmarks: the load generator behind `tools/bench`, and the measurements in
docs/benchmarks.md. Nothing here is imported by the server.

    python -m tools.benchmarks ...      the load generator (= tools/bench; cli.py)
    python -m tools.benchmarks.X ...    one measurement: docs (all of docs/benchmarks.md),
                                        step, step_account, scheduling, swap, speculative,
                                        grpc_vs_http, bf16_parity, plots
    python -m tools.benchmarks --compare shuttle,vllm,llamacpp    against the peers (peers.py)

The load generator in layers, each importing only those below it (no cycle):

    cli          the command: a workload, a server (given or started), rates, baselines
    load         streamed requests at a rate -> Timing per request
    baselines    transformers `generate` on the same prompts
    plots        PNGs of a result
    report       Timing, percentiles, goodput, the printed report
    client       a lean HTTP/1.1 SSE client
    workload     prompts and output lengths

The measurements (docs, scheduling, grpc_vs_http, ...) import the load generator's modules;
none of those imports a measurement.
"""

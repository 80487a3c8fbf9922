"""`batchscope bench serve`: a load client for any OpenAI-compatible server.

    dataset   the requests: a seeded long-tailed mix (`mixed`) or a file
    client    probing the server, streaming requests with Poisson arrivals / a concurrency cap
    metrics   TTFT, TPOT, ITL, E2E latency statistics, throughput, goodput; the text report

Runs are stored by app/db/benchmarks.py and shown by app/web/pages/benchmarks.py.
"""

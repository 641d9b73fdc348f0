"""Benchmark of search-QA retrieval (infra/env_backends.py): latency of the in-process BM25 retriever and of the
HTTP client against retrieval_server.py on loopback (the same BM25 behind it), per query, for a
batch of queries (the questions of the shipped test split) and for single queries.

Run:  python scripts/bench_search.py [--data data/search_qa] [--batch 64] [--repeats 20] [--k 3]
Reports the median over `repeats` calls (the first call, which warms caches, is not counted).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from infra import env_backends  # noqa: E402
import retrieval_server  # noqa: E402  (scripts/, beside this file)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/search_qa")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--k", type=int, default=3)
    a = p.parse_args(argv)
    questions = [q["question"] for q in env_backends.list_qa(a.data, "test")]
    batch = (questions * (a.batch // len(questions) + 1))[:a.batch]
    bm25 = env_backends.BM25Retriever(f"{a.data}/corpus.jsonl")
    server = retrieval_server.make_server(bm25, "127.0.0.1", 0)
    retrieval_server.serve_in_thread(server)
    http = env_backends.HTTPRetriever(f"http://127.0.0.1:{server.server_address[1]}", timeout=10)
    try:
        for name, r in (("bm25 in-process", bm25), ("http loopback", http)):
            b = _median_ms(lambda: r.search(batch, a.k), a.repeats)
            s = _median_ms(lambda: r.search(batch[:1], a.k), a.repeats)
            print(f"{name:16s} batch of {a.batch}: {b:7.2f} ms ({b / a.batch:.3f} ms/query) | "
                  f"single query: {s:6.2f} ms  ({len(bm25.passages)} passages, k={a.k})")
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()

"""A small retrieval server that speaks the Search-R1 protocol, serving env_backends.BM25Retriever over a
JSONL corpus (stdlib `http.server`; no web framework).

Protocol (the one of Search-R1's `search_r1/search/retrieval_server.py`, so `env_backends.HTTPRetriever`
talks to either server):
    POST /retrieve  {"queries": ["...", ...], "topk": 3, "return_scores": true}
    200             {"result": [[{"document": {"id": "...", "contents": "\\"Title\\"\\ntext"},
                                  "score": 12.3}, ...], ...]}     one list per query, best first
With "return_scores" false each hit is the bare document. `topk` missing or null: the server's
--topk. A malformed request gets 400 with {"error": "..."}; GET / answers {"status": "ok", ...}.

Choices, all **[ours]**:
1. `contents` is `"<title>"\\n<text>`, the layout of Search-R1's wiki-18 corpus, so a client that
   splits title and text the Search-R1 way reads our passages right.
2. `--delay` seconds of sleep before each answer, to test client timeouts against a real server.
3. Threaded (one thread per request); BM25 retrieval is read-only, so requests need no lock.
   Requests over 1 MB, more than 1024 queries or topk outside 1..100 are refused (400).

Run:   python scripts/retrieval_server.py --corpus data/search_qa/corpus.jsonl --port 8000
Use:   python train.py --env search --retriever_url http://127.0.0.1:8000
Test:  python -m pytest -q tests/test_search.py -k http
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

MAX_BODY = 1 << 20
MAX_QUERIES = 1024
MAX_TOPK = 100


def _document(p: dict) -> dict:
    return {"id": p["id"], "contents": f'"{p["title"]}"\n{p["text"]}'}


def make_server(retriever, host: str = "127.0.0.1", port: int = 0, topk: int = 3,
                delay: float = 0.0) -> ThreadingHTTPServer:
    """A server bound to (host, port) (port 0: any free port, see `server.server_address`);
    call `serve_forever()` (e.g. in a thread) and `shutdown()`."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") in ("", "/health"):
                self._send(200, {"status": "ok", "passages": len(getattr(retriever, "passages", []))})
            else:
                self._send(404, {"error": f"no such path {self.path}; POST /retrieve"})

        def do_POST(self):  # noqa: N802
            if self.path.rstrip("/") != "/retrieve":
                return self._send(404, {"error": f"no such path {self.path}; POST /retrieve"})
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                return self._send(400, {"error": f"request body over {MAX_BODY} bytes"})
            try:
                req = json.loads(self.rfile.read(n) or b"null")
                queries, k = req["queries"], req.get("topk") or topk
                if not (isinstance(queries, list) and all(isinstance(q, str) for q in queries)):
                    raise ValueError("'queries' must be a list of strings")
                if len(queries) > MAX_QUERIES:
                    raise ValueError(f"more than {MAX_QUERIES} queries")
                if not isinstance(k, int) or not 1 <= k <= MAX_TOPK:
                    raise ValueError(f"'topk' must be an integer in 1..{MAX_TOPK}")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                return self._send(400, {"error": f"bad request: {e}"})
            if delay:
                time.sleep(delay)
            try:
                hits = retriever.search(queries, k)
            except Exception as e:  # noqa: BLE001 - the client gets a 500 naming the error
                return self._send(500, {"error": f"retrieval failed: {type(e).__name__}: {e}"})
            if req.get("return_scores", False):
                result = [[{"document": _document(p), "score": p.get("score")} for p in row] for row in hits]
            else:
                result = [[_document(p) for p in row] for row in hits]
            self._send(200, {"result": result})

        def log_message(self, fmt, *args):  # quiet: one line per request would flood the logs
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, daemon=True, name="rsipo-retrieval-server")
    t.start()
    return t


def main(argv=None) -> None:
    from infra.env_backends import BM25Retriever
    p = argparse.ArgumentParser(description="Search-R1-protocol retrieval server over a JSONL corpus (BM25)")
    p.add_argument("--corpus", default="data/search_qa/corpus.jsonl", help="JSONL of {id, title, text}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--topk", type=int, default=3, help="passages per query when a request gives none")
    p.add_argument("--delay", type=float, default=0.0, help="[ours] seconds to sleep before each answer (tests)")
    a = p.parse_args(argv)
    retriever = BM25Retriever(a.corpus)
    server = make_server(retriever, a.host, a.port, a.topk, a.delay)
    host, port = server.server_address[:2]
    print(f"serving {len(retriever.passages)} passages of {a.corpus} on http://{host}:{port}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()

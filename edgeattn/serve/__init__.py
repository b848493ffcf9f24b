"""`edgeattn serve`: an OpenAI-compatible server (the `serve` extra).

engine.py   the scheduler: continuous batching over ``Streams``, prefill in bounded pieces, text out
            (knows nothing of HTTP; tests/test_serve_engine.py drives it directly)
cache.py    the prefix-state cache: states under a hash of their token ids, LRU by bytes, state files
            on disk within their own budget (LRU too)
app.py      the HTTP layer (FastAPI): OpenAI's request and response bodies, errors, SSE, /metrics, /
server.py   uvicorn in this process, graceful SIGTERM
ray.py      the same app as a Ray Serve deployment (`--ray --replicas N`, the `ray` extra)
static/     the chat page served at /
"""

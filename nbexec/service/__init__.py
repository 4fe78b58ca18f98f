"""`nbexec serve`: the HTTP service (the server extra).

    server      the FastAPI app: settings, execution and session routes, readiness
    gateway     the front door: Host, token and body-size checks from the headers alone
    runs        who a request is (the OpenAPI bearer scheme), per-token slots and threads, HTTP errors
    streaming   server-sent events of a run (sse-starlette): keep-alive, interrupt when the client goes
    files       the file and image routes, streamed from their owner's folder
    schemas     request bodies and typed responses (pydantic)
    metrics     /metrics with prometheus_client, in a registry of each app's own
    playground  the page at / (static files in playground/)
    tenants     what each token holds: sessions, one-shot results, worker threads
"""

"""`nbexec serve`: the HTTP service (the server extra).

    server      the FastAPI app: settings, execution and session routes, readiness
    gateway     the front door: Host, token, a router's signed client header and body-size checks, from headers
    runs        who a request is (the OpenAPI bearer scheme), per-token slots and threads, HTTP errors
    streaming   server-sent events of a run (sse-starlette): keep-alive, interrupt when the client goes
    files       the file and image routes, streamed from their owner's folder
    schemas     request bodies and typed responses (pydantic)
    metrics     /metrics with prometheus_client, in a registry of each app's own
    playground  the page at / (static files in playground/)
    tenants     what each token holds: sessions, one-shot results, worker threads
    node        /v1/capacity: this server as a node of a cluster
    router      `serve --nodes`: the router's own routes, and where each other call goes (cluster_cli starts it)
    relay       the router's one forwarding path: signed for the client, answers relayed within caps
    sse         a node's events re-framed as they arrive (pure)
    fleet       the router's configured nodes, their health and placement
    identity    the signed X-Nbexec-For header and the ids a router's clients hold (pure)
"""

"""`nbexec serve`: the HTTP service (the server extra).

    server   the FastAPI app: routes, streaming, readiness, metrics
    gateway  the front door: Host, token and body-size checks from the headers alone
    tenants  what each token holds: sessions, one-shot results, worker threads
"""

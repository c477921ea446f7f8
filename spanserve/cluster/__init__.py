"""Scale-out: N engine replicas behind one HTTP address, with Ray Serve (docs/scale-out.md).

`ingress` forwards each HTTP request to a replica chosen by `router`, which counts the request's
KV block hashes (`keys`) that each replica holds; `replica` runs the request through the same
FastAPI app as `spanserve serve` (`asgi`), and `launch` starts it all. Only this package imports
Ray, and only `spanserve serve --replicas` imports this package: nothing below it knows of Ray.
"""

"""The request path: the gRPC server and its processes (server.py), the one handler shape and its
error boundary (handlers.py), each RPC bound to the SQL its proto method names (rpcs.py), the
checks on requests (validation.py), rows to messages (messages.py), database errors to gRPC
statuses (errors.py), who may call what (auth.py), the wakes and event streams (wake.py,
signals.py) and the RPC metrics (metrics.py). It runs in every service process, for every call.
"""

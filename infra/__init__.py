"""Support code the concept files may use: ranks, sharding and checkpoints (distributed.py), the
environments' engines, data and retrievers (env_backends.py), atomic file writes (io.py)."""

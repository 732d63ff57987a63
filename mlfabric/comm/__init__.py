"""Transports and collective algorithms: the shared-memory engine (shm), MPI point-to-point
algorithms (algorithms, p2p), call headers and mismatch checks (header), async handles (executor)."""

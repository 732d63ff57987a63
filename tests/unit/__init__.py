"""Tests in one process: no MPI job (pure computation, argument checks, the native core)."""

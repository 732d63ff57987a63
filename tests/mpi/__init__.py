"""Tests that start real mpirun jobs on this host (--oversubscribe); each case module lives in tests/mpi_cases."""

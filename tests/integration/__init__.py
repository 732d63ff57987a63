"""Tests of the shipped scripts, benchmarks and paper reproductions, end to end under mpirun."""

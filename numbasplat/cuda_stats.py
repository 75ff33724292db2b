"""A count of Numba kernel launches, for the benchmark's launches-per-step figure."""
launches = 0

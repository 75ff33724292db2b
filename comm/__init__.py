"""Inter-rank communication for distributed training.

``alltoallv``: ``Exchange`` (variable-size all-to-all of row arrays, host or
device), ``allreduce_sum``/``allgatherv`` helpers and ``abort_on_error``.
``sparse``: the zero-eliding gradient encoding (bitmap + packed rows) and the
sparse/dense gradient exchanges built on ``Exchange``.
``libraries``: MPI and NCCL loaded in one place (``load_mpi`` raises ``MPIUnavailable``,
one line naming the fix, when mpi4py has no MPI library to load).

Names are loaded lazily so that ``import comm.sparse`` (encode/decode only)
does not initialise MPI.
"""
_EXPORTS = {
    "Exchange": "alltoallv", "HostStaged": "alltoallv", "CudaAware": "alltoallv", "Transport": "alltoallv",
    "abort_on_error": "alltoallv", "fail_all": "alltoallv", "cuda_aware_mpi": "alltoallv",
    "encode": "sparse", "decode_add": "sparse", "scatter_add": "sparse",
    "exchange_sparse": "sparse", "exchange_dense": "sparse",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

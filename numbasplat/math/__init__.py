"""The math both backends share, written once: ``@shared`` (inline ``njit``) scalar functions
that the CPU ``njit`` kernels and the ``@cuda.jit`` kernels call alike, and their constants.

``jit``: the ``shared`` decorator and ``SIM``.  ``geometry``: EWA projection of one Gaussian
and its VJP.  ``sh``: the spherical-harmonics basis.  ``blend``: per-pixel compositing and its
VJP.  ``gaussian_ops``: the per-Gaussian kernel bodies and the record layouts.  ``ssim``: the
per-pixel SSIM, S3IM and L1 math of the losses.  ``adam``: one Adam update.  ``tiles``: the
16x16 tile size and tile arithmetic.  ``sparse``: the layout of the zero-eliding gradient
messages.  ``noise``: counter-based Gaussian noise (a draw per element index, whatever the sharding).
"""

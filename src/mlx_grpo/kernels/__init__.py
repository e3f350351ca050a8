"""The project's CUDA kernels (mx.fast.cuda_kernel), each beside the plain-MLX reference it must equal, and the
one check of whether they run here (`available`):

  attention.py        decode attention over left-padded rows without a mask array: the plain kernel and the
                      log-sum-exp one (the engine's copy merges the token's own slot into it); the CUDA source
                      pieces the attention kernels share
  fused_attention.py  the engine copy's whole attention for one layer in one launch: RoPE, the cached slots
                      split across warps, the token's own slot (and its keys/values written into the cache)
  cache_write.py      a refill's admitted rows' keys/values written into done rows' cache slots in place
  keyed_sampler.py    the sampler's per-row random bits: MLX's draws for one key per row, written coalesced;
                      `categorical`, the sampler's one call (the kernel here, MLX's own draws elsewhere)

Callers ask `available()` and call the kernel's function; nothing else chooses between a kernel and its
reference. tests/test_cuda_kernels.py (the gpu tier) checks every kernel against its reference on a CUDA device;
CPU tests check what can be checked without one (the keyed bits' counter layout through a numpy threefry).
"""

from __future__ import annotations

import mlx.core as mx


def available() -> bool:
    """The kernels run on MLX's CUDA backend only, with the GPU as the default device (Metal's own decode
    attention already takes masks; its random bits are not the bottleneck)."""
    return hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu

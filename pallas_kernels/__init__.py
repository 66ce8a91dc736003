"""Pallas kernels for block-sparse paged decode attention (TPU / GPU) and an optional jax-triton path.

All share the signature of ``sparrow_jax.attention.contract.sparse_decode_reference``:
``(q [B,H,D], k_pages [B,Hkv,P,S,D], v_pages, page_idx [B,Hkv,N], page_valid [B,Hkv,N],
positions [B], scale=None, ...) -> [B,H,D]``.
"""
from pallas_kernels.sparse_decode_gpu import sparse_decode_gpu
from pallas_kernels.sparse_decode_tpu import sparse_decode_tpu
from pallas_kernels.triton_path import sparse_decode_triton, triton_available

__all__ = ["sparse_decode_gpu", "sparse_decode_tpu", "sparse_decode_triton", "triton_available"]

"""Paged KV cache, page selection and decode attention (dense and block-sparse)."""
from sparrow_jax.attention.cache import PagedKVCache, append_token, init_cache, page_metadata, write_prefill
from sparrow_jax.attention.decode import (IMPLEMENTATIONS, dense_decode, dense_decode_dispatch, resolve_impl,
                                          score_select_decode, select_pages_decode, sparse_decode,
                                          sparse_decode_reference, sparse_decode_xla)
from sparrow_jax.attention.contract import check_decode_inputs, selected_page_mask, sparse_decode_reference
from sparrow_jax.attention.selection import group_mean_query, score_pages, select_pages

"""Paged KV cache: host block accounting (block_pool, kv_cache_manager, block_table) and device ops (kv_cache)."""

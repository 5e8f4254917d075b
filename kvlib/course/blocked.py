"""What each graded question blocks: everything in kvlib that computes the asked-for result (the
function the question names and its "twins"), one tuple per family. A question lists one or more
of them in `@question(blocked=...)`; `kvlib.course.guards` makes them unavailable to the learner's
code while it is graded. Library code calling them is never blocked.
"""

# Everything in kvlib that computes a cache's bytes: a question about bytes blocks all of it (a
# "twin" such as cache_report(...).total_bytes would answer kv_cache_bytes's question).
MEMORY_API = (
    "kvlib.memory.formula.dense_kv_cache_bytes",
    "kvlib.memory.formula.kv_elements_per_token",
    "kvlib.memory.kv_bytes_per_token",
    "kvlib.memory.kv_cache_bytes",
    "kvlib.memory.cache_report",
    "kvlib.memory.layer_specs",
    "kvlib.memory.memory_budget",
    "kvlib.memory.max_concurrent_sequences",
    "kvlib.memory.equation.quantized_kv_cache_bytes",
    "kvlib.quant.QuantScheme.bytes_per_vector",
    "kvlib.quant.QuantScheme.scales_per_vector",
    "kvlib.quant.QuantizedTensor.nbytes",
    "kvlib.cache.quantized.QuantizedCache",  # holds one token, reports its nbytes
    "kvlib.cache.quantized.QuantizedPagedCache",
)
# Everything in kvlib that computes rotary embeddings
ROPE_API = (
    "kvlib.layers.llama.apply_rope",
    "kvlib.layers.llama.rope_cos_sin",
    "kvlib.layers.llama.rope_inverse_frequencies",
    "kvlib.layers.llama.rotate_half",
)
# Everything in kvlib that computes attention (torch's SDPA is detected separately)
ATTENTION_API = (
    "kvlib.ops.attention.grouped_attention",
    "kvlib.ops.attention.reference_attention",
    "kvlib.ops.attention.sdpa_attention",
    "kvlib.cache.paged.paged_attention",
    "kvlib.kernels.paged_decode_attention",
    "kvlib.kernels.paged_decode_attention_ref",
    "kvlib.ref.attention.attention",
    "kvlib.ref.attention.softmax",
)


# Everything in kvlib that maps a token to its pool slot through a block table
PAGING_API = (
    "kvlib.cache.paged.read_slots",
    "kvlib.cache.paged.gather_kv",
    "kvlib.cache.paged.PagedCache",
    "kvlib.cache.block_manager.BlockManager",
)
# Everything in kvlib that decides which tokens an eviction policy keeps, or scores them: the
# policies, the caches and the engine's block-level window that run them
EVICTION_API = (
    "kvlib.cache.evicting.EvictionPolicy",
    "kvlib.cache.eviction_policies.StreamingLLM",
    "kvlib.cache.eviction_policies.H2O",
    "kvlib.cache.eviction_policies.TOVA",
    "kvlib.cache.eviction_policies.SnapKV",
    "kvlib.cache.eviction_policies.RandomEviction",
    "kvlib.cache.evicting.EvictingCache",
    "kvlib.cache.eviction_policies._most_recent",
    "kvlib.cache.evicting.token_scores_from_lse",
    "kvlib.cache.compaction.CompactingPagedCache",
    "kvlib.engine.scheduler.StreamingEviction",
)
# Everything in kvlib that plans or performs a compaction pass, or frees emptied blocks
COMPACTION_API = (
    "kvlib.cache.compaction_plans.freeable_blocks",
    "kvlib.cache.compaction_plans.plan_repack",
    "kvlib.cache.compaction_plans.plan_hole_filling",
    "kvlib.cache.compaction.SlotMap",
    "kvlib.cache.compaction.CompactingPagedCache",
    "kvlib.cache.block_manager.BlockManager",  # drop_blocks, move_slots
)
# Everything in kvlib that quantizes (computes scales, zero points, codes or packed bytes)
QUANT_API = (
    "kvlib.quant.quantize",
    "kvlib.quant.pack_bits",
    "kvlib.quant._grouped",
    "kvlib.quant.cat_quantized",
    "kvlib.cache.quantized.QuantizedCache",
    "kvlib.cache.quantized.QuantizedPagedCache",
)
# Everything in kvlib that schedules requests (the scheduler and the engines that drive it)
SCHEDULER_API = (
    "kvlib.engine.scheduler.Scheduler",
    "kvlib.engine.llm_engine.LLMEngine",
    "kvlib.engine.workload.run_workload",
)
# Everything in kvlib that names a block across processes and tiers (chapter 14)
OFFLOAD_KEYS_API = ("kvlib.offload.keys.salted_block_keys", "kvlib.offload.keys.block_key")
# Everything in kvlib that moves blocks between memory tiers
OFFLOAD_TIERS_API = (
    "kvlib.offload.store.TieredStore",
    "kvlib.offload.store.MemoryTier",
    "kvlib.offload.disk.DiskTier",
    "kvlib.offload.engine.OffloadEngine",
)
# Everything in kvlib that weighs shipping K/V against recomputing it (and the bytes it needs)
BREAK_EVEN_API = (
    "kvlib.offload.breakeven.break_even_bandwidth",
    "kvlib.offload.breakeven.prefill_flops",
    "kvlib.offload.breakeven.kv_transfer_bytes",
    *MEMORY_API,
)

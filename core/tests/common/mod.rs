//! What more than one integration test writes from vLLM's definitions (not from pdkv's code).

/// The KV heads shard `shard` of `shards` holds of `total`, as vLLM splits them over
/// tensor-parallel ranks (or DCP head groups): contiguous ranges, or, with more shards than
/// heads, each head replicated on `shards / total` consecutive shards.
pub fn vllm_heads(total: u32, shards: u32, shard: u32) -> Vec<u32> {
    if shards <= total {
        let per = total / shards;
        (shard * per..(shard + 1) * per).collect()
    } else {
        vec![shard * total / shards]
    }
}

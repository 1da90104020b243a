"""`jaxtyping_shard.jit`: boundary checks, and `jit`'s shardings from annotations."""

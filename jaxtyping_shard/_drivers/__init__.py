"""The annotation drives the program: `shardings`, `reshard`, `place`,
`sharded_init`, `jit` and `typed_shard_map`, each from the same layouts."""

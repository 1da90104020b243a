"""Does a value's sharding match its layout: eagerly, at trace time (Explicit
axes), when XLA compiles (Auto axes), inside `shard_map` (Manual axes)."""

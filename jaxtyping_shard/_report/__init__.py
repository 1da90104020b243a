"""What is told: `explain`'s table of shards and bytes per device."""

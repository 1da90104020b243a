"""`sharded_init` and `abstract`: parameters created where they will live."""

"""What an annotation asks for: parsed into a layout, resolved through the rules,
made into a `PartitionSpec` and a `NamedSharding` (`bridge`)."""

"""What users write (`Float[Array, "b@data e"]`) and how checkers see it: the
dtype classes, typeguard's lookup, `jaxtyped`'s messages, static indirection."""

"""The one tree walk (each leaf's path and annotation) and the checks of whole
trees built on it (`check_tree`, `Tree[T]`)."""

"""`place`, `place_for`, `local_rows`: host-local data laid out as annotated."""

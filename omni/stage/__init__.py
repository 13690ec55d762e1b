"""Stage workers: one process per stage replica."""

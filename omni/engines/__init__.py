"""Stage engines behind one small interface (see base.py)."""

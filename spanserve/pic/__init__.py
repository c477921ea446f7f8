"""Position-independent spans: prompt parts (prompt.py), KV layout (layout.py), link policies (link.py)."""

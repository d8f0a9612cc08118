"""Per-target lowering: lanes, tiles and row blocks (CPU) behind ``backends``."""

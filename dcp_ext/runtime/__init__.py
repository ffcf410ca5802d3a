"""Process-level helpers the other layers share (caches), free of checkpoint formats."""

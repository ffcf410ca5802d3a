"""Storage layer: where bytes live (local disk or fsspec) and how DCP reaches them."""

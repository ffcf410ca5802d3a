"""On-disk formats: torch.save records, the pyarrow index, metadata pickles."""

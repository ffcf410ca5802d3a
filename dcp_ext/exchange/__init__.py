"""Exchange layer: moving checkpoint bytes between ranks with torch.distributed."""

"""Data sources, packing and balancing for training runs."""

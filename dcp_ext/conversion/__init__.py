"""Whole-checkpoint conversions between formats (streaming, one tensor batch at a time)."""

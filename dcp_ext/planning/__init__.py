"""Planners: what each rank saves or loads."""

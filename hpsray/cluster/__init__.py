"""Embedded versus existing Ray cluster, node placement, collective groups and consistency."""

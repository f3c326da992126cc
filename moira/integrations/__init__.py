"""Serving-engine integrations (each imports its engine only when used)."""

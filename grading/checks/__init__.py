"""Registered checks, one module per lab."""

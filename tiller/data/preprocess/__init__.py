"""Converters from public datasets to verl's RL parquet schema (one module per dataset)."""

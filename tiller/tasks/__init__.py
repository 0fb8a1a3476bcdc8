"""Built-in verifiable tasks (procedurally generated, no download): `arithmetic` is the demo's task."""

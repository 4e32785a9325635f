"""Processes: JAX's multi-controller runtime joined and read across (`cluster`), the local
launcher (`launcher`), process-wide JAX settings and memory (`settings`), and files written
whole or not at all (`disk`)."""

"""The shared-memory segment: the versioned layout a sidecar writes and loaders attach to (SPEC.md)."""

"""The streaming sidecar: parallel range readers from a source into a shared-memory segment."""

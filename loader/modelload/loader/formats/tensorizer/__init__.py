"""The tensorizer file format (CoreWeave), read and written independently of the tensorizer package."""

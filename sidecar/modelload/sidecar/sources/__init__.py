"""Model sources: read a byte range of a file, an HTTP(S) URL or an S3 object into a buffer."""

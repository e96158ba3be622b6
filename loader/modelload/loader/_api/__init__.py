"""The attach API that inference code imports, re-exported by modelload.loader."""

"""memtoc: the MemToC benchmark (memory-tool conflict resolution) as a reproducible paper package."""
__version__ = "0.1.0"

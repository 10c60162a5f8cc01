"""memtoc: the MemToC benchmark (memory-tool conflict resolution) as a reproducible paper package.

Importing memtoc changes nothing in the process. Its entry points (``memtoc.run``, which every notebook
imports first, and the ``memtoc`` command) set passive OpenMP waits before torch starts:
:func:`memtoc.generation.hardware.passive_openmp_waits`."""

__version__ = "0.1.0"

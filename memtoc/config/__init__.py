"""The run configuration: params files (defaults, validation), the typed ``RunConfig`` and its blocks,
``RunPaths`` (a run's files), the tested package locks. Imports ``core`` and ``generation``."""

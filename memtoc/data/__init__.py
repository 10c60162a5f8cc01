"""The benchmark data: the release (both layouts), its verified fetch, the run's question selection and
its episodes. Imports ``core``, ``generation`` and ``config``."""

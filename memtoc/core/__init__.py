"""The bottom layer: pure code with no run files (errors, vocabulary, records, prompts, scoring, metrics,
statistics, intervals, figures, io, progress, the project folder). It imports nothing else of memtoc."""

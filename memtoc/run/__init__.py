"""Running the stages: the stage registry, the papermill pipeline, notebook set-up, the run lock, the
dry run, merging runs, server and GPU checks, benchmarks, the docs snapshot. Imports every layer below."""

from memtoc.generation.hardware import passive_openmp_waits

passive_openmp_waits()   # before a stage imports torch (every notebook imports memtoc.run first)

"""What the tests, ci/ and perf/ share: kernel cases and their bounds, numpy and g++ emulations
of the kernels, synthetic and shape-true models, the goldens and tolerances, fakes of CuPy and
of a graph-capturing backend, and the library half of the ci/ and perf/ tools the suite checks
(kernel_sass, kernel_resources, gguf_mutations, soak_measures, perf_baseline). It imports
neither ci/ nor perf/ nor any test module, and the engine never imports it
(conformance/tools/test_import_graph.py)."""

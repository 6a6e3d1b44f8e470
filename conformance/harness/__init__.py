"""What tests and ci/ scripts share: kernel cases and their bounds, numpy emulations of
the kernels, synthetic and shape-true models. The engine never imports it."""

"""CUDA for the framework backends: devices, buffers and streams, graphs; every CUDA
library imported lazily, so nothing here needs a GPU to import."""

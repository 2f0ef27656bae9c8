"""Making each forward cheaper: precision, oneDNN, quantized linears, GGUF blocks, MX, attention kernels, compiled graphs, ONNX (lessons 05, 14-16)."""

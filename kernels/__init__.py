"""The ai.onnxcnn custom-operator library for ONNX Runtime: CUDA/C++ sources (src/), their build
(``python -m kernels.build``), the numpy reference of each operator's math (reference.py) and the small
ONNX graphs that exercise them (graphs.py). See README.md."""

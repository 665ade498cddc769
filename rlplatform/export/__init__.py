"""Trained policies as ONNX or TorchScript files, and running them without Ray (docs/export.md)."""

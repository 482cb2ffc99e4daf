"""Quantised weight formats kept quantised in memory: their encodings, reference dequantisation and layouts."""

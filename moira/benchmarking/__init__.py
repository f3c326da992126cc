"""Helpers for timing studies, not for decoding: imposed read fractions (random-weight TPOT
runs read a fixed share of pages per layer and KV head) and the CUDA kernels' timeline
probes (where a launch's time goes)."""

"""A stand-in `sglang` package for tests: SGLang itself needs a CUDA GPU and cannot run here.

Only `python -m sglang.launch_server` exists (launch_server.py). Tests put this directory
on PYTHONPATH so that `engines.launch: sglang` runs the real launcher, supervisor and
client path against a server that speaks the same HTTP API.
"""

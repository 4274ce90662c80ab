"""The repository's report generators (not installed with the package): run from the repo root as
`python -m benchmarks.claims`, `python -m benchmarks.peers`, `python -m benchmarks.spec_decode_ab`."""

"""The research experiments (docs/results/): `python -m experiments.run configs/experiments/<name>.yaml` trains
and evaluates every arm of an experiment file and writes its page; not a benchmark (benchmarks/ measures speed)."""

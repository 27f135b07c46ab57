"""The chaos suite: workload, harness and checker; `python -m tests.support.chaos.run` is `make chaos`."""

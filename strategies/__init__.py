"""Flower's server side of fedlora: the ServerApp, the one strategy for all seven algorithms, SecAgg+ rounds, the
canary audit and an in-process Grid for tests and benchmarks; the math they call is in ``fedlora``."""

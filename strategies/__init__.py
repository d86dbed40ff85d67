"""Flower server strategies (Message API) for the fedlora algorithms.

Empty until the federation milestone (issue 4): sampling, sketch aggregation, FlexLoRA's SVD
redistribution and the accounting hook will live here, on top of ``fedlora``'s pure math.
"""

"""fedlora: differentially private federated LoRA with sketched Gaussian mechanisms."""

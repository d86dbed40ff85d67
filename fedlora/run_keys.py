"""The keys the launcher, the ServerApp and the ClientApp pass outside the vocabulary (fedlora.config): a module of
its own, without imports, so that the ServerApp and the ClientApp read them before they load torch."""

OUT_DIR_KEY = "out-dir"  # where the ServerApp writes,
RESUME_KEY = "resume"  # whether it continues from the checkpoint there,
SIMULATION_KEY = "simulation"  # whether the simulation engine runs it (`fedlora run`),
NODES_KEY = "flower-nodes"  # how many Flower nodes the launcher started (simulation-nodes = 0: one per Ray worker)
NOISE_KEY = "calibrated-noise"  # and the noise multipliers the launcher calibrated ("z,z_probe"), not calibrated again
LAUNCH_KEYS = (OUT_DIR_KEY, RESUME_KEY, SIMULATION_KEY, NODES_KEY, NOISE_KEY)
WARM_UP = "warm-up"  # a query's config key: load the model and the data now, before round 1 (a simulation's)

# Hydra configs. This folder sits at the top of the repo and is installed as the package `ddpexp.conf`.

"""The slurm executor for lmlab: a sweep's variants as SLURM job arrays through submitit."""

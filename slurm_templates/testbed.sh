# Setup lines for the local test clusters: CPU-only nodes, so threads follow the CPUs granted.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export STREAMRL_SITE={{ site }}

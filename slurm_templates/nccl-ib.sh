# Setup lines for GPU nodes with InfiniBand inside the site: NCCL uses IB for the in-site weight
# broadcast; cross-site traffic goes over TCP (StreamRL's relay), never NCCL.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export NCCL_IB_DISABLE=0
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export STREAMRL_SITE={{ site }}

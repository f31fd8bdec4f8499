"""Metrics after the fact and on the side: mirroring trainer records, and plotting a run.

The rendezvous server already keeps every record in ``run_dir/metrics.jsonl`` (the source of
truth, readable without any server). This package adds what a person looks at:

    trainer ──record per iteration──► rendezvous ──► run_dir/metrics.jsonl
       └──► sinks: TensorBoard, W&B (optional extras), JSONL      metrics.sinks
    run_dir/metrics.jsonl ──► one record per iteration            metrics.read
        ──► reward, throughput, pipeline timeline, lengths PNGs   metrics.plots (`streamrl plot`)

TensorBoard, wandb and matplotlib are imported inside the functions that need them, so
importing this package costs nothing.
"""

from __future__ import annotations

from streamrl_cli.errors import StreamRLError


class MetricsError(StreamRLError):
    """Metrics cannot be written or plotted: a missing optional package, no iterations yet."""

"""Resource allocation for disaggregated RL: how many GPUs of which kind go to each stage.

    recipe ──► workload (model, batch, length distribution, mode)     planner.workload, .lengths
    hardware.yaml (+ user file) ──► GPU specs                          planner.hardware
    cost model: analytic roofline | profiled (`streamrl profile`)      planner.costmodel, .profile
        measured here, or by one SLURM job per hardware kind           streamrl_cli.profiling
        ──► P_gen(x): best TP / instances / batch on x GPUs            planner.generation
        ──► P_train(y): best TP×PP×DP / ZeRO / offload on y GPUs       planner.training
        ──► iteration time per mode (baseline, sync-stream, async)     planner.iteration
    Algorithm 1, two sites, hardware choice per role ──► options       planner.search, .problem
    table, JSON, overrides for `streamrl run`                          planner.report
    discrete-event simulator: checks the model's choices               planner.simulator, .dispatch,
                                                                       .scenario

Everything but profiling is pure: no clocks, sockets or subprocesses, so the search and the
simulator are deterministic and fast to test. Errors meant for users are the two classes below.
"""

from __future__ import annotations

from streamrl_cli.errors import StreamRLError


class PlannerError(StreamRLError):
    """Impossible planning input: the model does not fit, the budget is too small, a bad spec."""

    exit_code = 2


class ProfileError(StreamRLError):
    """`streamrl profile` could not measure (no local model, an engine failed to start, ...)."""

"""Skewness-aware generation: removing the bubble that long-tailed output lengths leave.

A few very long samples keep a whole batch, and the trainer waiting on it, busy. Two remedies from
the StreamRL paper live here as pure functions, shared by the real system and the simulator:

* :mod:`streamrl_cli.skew.dispatch_plan` — Algorithm 2: long-tail prompts (by predicted length) go to a
  few instances that run small batches, the regular ones fill the rest with large batches; it says
  which instance gets each prompt and how many sequences each instance runs at once;
* the in-instance order (Longest-Processing-Time first) is carried by each request's priority and
  enforced by the generator's admission queue (:mod:`streamrl_cli.generator.admission`).
"""

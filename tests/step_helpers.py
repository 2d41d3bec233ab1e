"""Shared test helpers: prompts for the default model, and driving the engine by hand."""

from __future__ import annotations

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Water boils at a temperature of",
    "The three primary colors are",
    "Translate to French: Good morning, my friend.",
    "In machine learning, overfitting means that the model",
]


def step_with_logits(engine):
    """One serial engine step by hand: (requests that got a token, the step's logits [B, V] in batch order).

    Reads the launched forward's logits (a runner internal) before sampling finishes the step.
    """
    sched = engine.scheduler.schedule()
    engine.runner.execute_model(sched)
    pending = engine.runner._pending
    logits = None if pending is None else pending.forward.result().logits.clone()
    out = engine.runner.sample_tokens().get()
    return engine.scheduler.update_from_output(sched, out), logits

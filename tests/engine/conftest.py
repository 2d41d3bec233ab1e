"""Engine-test fixtures: one AsyncLLM on the default model (fp32) with a stats recorder."""

from __future__ import annotations

import time

import pytest

from mrv2.engine.async_llm import AsyncLLM


class Recorder:
    def __init__(self):
        self.records = []
        self.delay = 0.0  # seconds each record takes (a slow stat logger)

    def record(self, scheduler, iteration):
        time.sleep(self.delay)
        self.records.append((scheduler, iteration))


@pytest.fixture(scope="module")
def recorder():
    return Recorder()


@pytest.fixture(scope="module")
def async_llm(recorder):
    llm = AsyncLLM(dtype="float32", max_model_len=512, max_num_seqs=8, kv_cache_memory=32 << 20,
                   stat_loggers=[recorder])
    yield llm
    llm.shutdown()

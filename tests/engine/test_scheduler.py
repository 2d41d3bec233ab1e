"""Scheduler: continuous batching, chunked prefill, preemption, aborts, finish reasons.

A fake runner mirrors what the real runner keeps per request (tokens, block table,
computed count) from the SchedulerOutputs alone, and checks the contract each step.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from mrv2.config import SchedulerConfig
from mrv2.engine.block_pool import NULL_BLOCK_ID
from mrv2.engine.request import Request, RequestStatus, validate_prompt_length
from mrv2.engine.scheduler import Scheduler
from mrv2.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from mrv2.sampling_params import SamplingParams

BS = 4  # block size
EOS = 0


def token_fn(req_id: str, pos: int) -> int:
    """Deterministic token at position `pos` of a request: what a seeded model would sample."""
    return 100 + (sum(map(ord, req_id)) * 31 + pos * 7) % 50


@dataclass
class _Slot:
    tokens: list[int]
    blocks: list[int]
    computed: int


@dataclass
class FakeRunner:
    """Keeps runner-side request state and asserts the scheduler -> runner contract."""

    block_size: int = BS
    token_fn: object = token_fn
    slots: dict[str, _Slot] = field(default_factory=dict)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            assert rid in self.slots, f"runner never had {rid}"
            del self.slots[rid]
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.slots and nr.num_computed_tokens == 0
            assert nr.all_token_ids[:len(nr.prompt_token_ids)] == nr.prompt_token_ids
            self.slots[nr.req_id] = _Slot(list(nr.all_token_ids), list(nr.block_ids), 0)
        cr = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens):
            slot = self.slots[rid]
            assert slot.computed == computed
            slot.blocks += blocks
        assert set(so.num_scheduled_tokens) == {r.req_id for r in so.scheduled_new_reqs} | set(cr.req_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        sampled = []
        for rid, n in so.num_scheduled_tokens.items():
            slot = self.slots[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            assert n >= 1 and slot.computed + n - len(drafts) <= len(slot.tokens)
            slot.computed += n
            assert len(slot.blocks) * self.block_size >= slot.computed and NULL_BLOCK_ID not in slot.blocks
            if slot.computed >= len(slot.tokens):
                # Verify the drafts: accept while each equals the token the model samples there.
                emitted = []
                for draft in drafts + [None]:
                    tok = self.token_fn(rid, len(slot.tokens))
                    slot.tokens.append(tok)
                    emitted.append(tok)
                    if tok != draft:
                        break
                slot.computed -= len(drafts) + 1 - len(emitted)  # rejected drafts' KV does not count
                sampled.append(emitted)
            else:
                sampled.append([-1])  # partial prefill: garbage the scheduler must ignore
        return ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled)


def make_sched(*, seqs: int = 16, budget: int = 64, chunked: bool = True, blocks: int = 64,
               max_len: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    return Scheduler(cfg, block_size=BS, num_gpu_blocks=blocks, max_model_len=max_len)


def make_req(rid: str, prompt_len: int, max_tokens: int | None = 4, eos: int | None = EOS, **kw) -> Request:
    return Request(rid, [1 + i % 90 for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_ids=() if eos is None else (eos,))


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, runner.execute(so))


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list[Request]:
    """Step until idle; return finished requests in finishing order."""
    done = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, updated = step(sched, runner)
        done += [r for r in updated if r.is_finished]
    assert not sched.has_unfinished_requests()
    step(sched, runner)  # flush finished ids to the runner
    assert not runner.slots and sched.block_pool.is_whole()
    return done


def expected_output(r: Request) -> list[int]:
    return [token_fn(r.req_id, r.num_prompt_tokens + i) for i in range(r.num_output_tokens)]


def test_single_request_prefill_then_decode():
    sched, runner = make_sched(), FakeRunner()
    r = make_req("a", 7, max_tokens=4)
    sched.add_request(r)
    so, updated = step(sched, runner)
    (nr,) = so.scheduled_new_reqs
    assert nr.num_computed_tokens == 0 and nr.block_ids == [1, 2] and so.num_scheduled_tokens == {"a": 7}
    assert updated == [r] and r.num_output_tokens == 1 and r.num_computed_tokens == 7
    so, _ = step(sched, runner)  # token 7 goes into block 2
    assert so.scheduled_cached_reqs.req_ids == ["a"] and so.scheduled_cached_reqs.new_block_ids == [[]]
    assert so.scheduled_cached_reqs.num_computed_tokens == [7] and so.num_scheduled_tokens == {"a": 1}
    so, _ = step(sched, runner)  # token 8 needs block 3
    assert so.scheduled_cached_reqs.new_block_ids == [[3]]
    _, updated = step(sched, runner)
    assert r.is_finished and r.finish_reason == "length" and r.output_token_ids == expected_output(r)
    assert r.num_output_tokens == 4 and sched.block_pool.is_whole() and not sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty
    assert sched.schedule().finished_req_ids == set()


def test_continuous_batching_mixed_prefill_and_decode():
    sched, runner = make_sched(), FakeRunner()
    a = make_req("a", 5, max_tokens=10)
    sched.add_request(a)
    step(sched, runner)
    step(sched, runner)
    b = make_req("b", 6, max_tokens=3)
    sched.add_request(b)
    so, updated = step(sched, runner)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"] and so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.num_scheduled_tokens == {"a": 1, "b": 6} and so.total_num_scheduled_tokens == 7
    assert updated == [a, b] and a.num_output_tokens == 3 and b.num_output_tokens == 1
    done = run_all(sched, runner)
    assert [r.req_id for r in done] == ["b", "a"]
    assert all(r.output_token_ids == expected_output(r) for r in done)


def test_chunked_prefill_small_budget():
    sched, runner = make_sched(budget=8), FakeRunner()
    a = make_req("a", 3, max_tokens=6)
    sched.add_request(a)
    step(sched, runner)
    b = make_req("b", 20, max_tokens=2)
    sched.add_request(b)
    chunks = []
    for _ in range(3):
        so, updated = step(sched, runner)
        assert so.num_scheduled_tokens["a"] == 1  # the decode goes first
        chunks.append(so.num_scheduled_tokens["b"])
        assert so.total_num_scheduled_tokens <= 8
        assert b not in updated or b.num_computed_tokens == 20
    assert chunks == [7, 7, 6] and b.num_output_tokens == 1
    assert b.output_token_ids == [token_fn("b", 20)]
    done = run_all(sched, runner)
    assert {r.req_id: r.num_output_tokens for r in done} == {"a": 6, "b": 2}


def test_chunked_prefill_partial_steps_emit_nothing():
    sched, runner = make_sched(budget=5), FakeRunner()
    r = make_req("a", 12, max_tokens=2)
    sched.add_request(r)
    counts = []
    for _ in range(3):
        so, updated = step(sched, runner)
        counts.append((so.num_scheduled_tokens["a"], len(updated)))
    assert counts == [(5, 0), (5, 0), (2, 1)]
    assert r.output_token_ids == [token_fn("a", 12)]
    run_all(sched, runner)


def test_no_chunking_stops_admission_when_prompt_does_not_fit():
    sched, runner = make_sched(budget=32, chunked=False, max_len=32), FakeRunner()
    for rid, n in (("a", 20), ("b", 20), ("c", 2)):
        sched.add_request(make_req(rid, n, max_tokens=3))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 20}  # b does not fit 12; c waits behind it (FCFS)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 20, "c": 2}
    run_all(sched, runner)


def test_no_chunking_requires_budget_for_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_sched(budget=16, chunked=False, max_len=32)


def test_max_num_seqs_and_fcfs():
    sched, runner = make_sched(seqs=2), FakeRunner()
    reqs = [make_req(f"r{i}", 4, max_tokens=3) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    so, _ = step(sched, runner)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r0", "r1"] and len(sched.running) == 2
    assert sched.get_num_unfinished_requests() == 4
    admitted = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        assert len(sched.running) <= 2 and len(so.num_scheduled_tokens) <= 2
        admitted += [n.req_id for n in so.scheduled_new_reqs]
    assert admitted == ["r2", "r3"]
    run_all(sched, runner)


def test_preemption_resumes_with_earlier_outputs():
    # 6 usable blocks of 4 tokens; each request grows to 8 + 12 - 1 = 19 tokens of KV (5 blocks).
    sched, runner = make_sched(blocks=7, max_len=64), FakeRunner()
    a, b = make_req("a", 8, max_tokens=12), make_req("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    preempt_step = resumed = None
    done = []
    for i in range(200):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        if b.status == RequestStatus.PREEMPTED and preempt_step is None:
            preempt_step = i
            assert "b" in so.finished_req_ids and "b" not in so.num_scheduled_tokens
            assert b.block_ids == [] and b.num_computed_tokens == 0 and sched.waiting[0] is b
            outputs_at_preemption = list(b.output_token_ids)
            assert outputs_at_preemption
        for nr in so.scheduled_new_reqs:
            if nr.req_id == "b" and preempt_step is not None:
                resumed = nr
                assert nr.all_token_ids == b.prompt_token_ids + outputs_at_preemption
                assert nr.prompt_token_ids == b.prompt_token_ids and nr.num_computed_tokens == 0
        done += [r for r in sched.update_from_output(so, runner.execute(so)) if r.is_finished]
    assert preempt_step is not None and resumed is not None
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert b.num_preemptions >= 1 and sched.num_preemptions >= 1
    assert [r.req_id for r in done] == ["a", "b"]
    for r in (a, b):
        assert r.num_output_tokens == 12 and r.output_token_ids == expected_output(r)
    run_all(sched, runner)


def test_preempted_request_goes_to_front_and_blocks_admission():
    sched, runner = make_sched(seqs=2, blocks=7, max_len=64), FakeRunner()
    a, b, c = make_req("a", 8, max_tokens=12), make_req("b", 8, max_tokens=12), make_req("c", 1, max_tokens=1)
    for r in (a, b, c):
        sched.add_request(r)
    admitted = []
    while b.num_preemptions == 0:
        so, _ = step(sched, runner)
        admitted += [n.req_id for n in so.scheduled_new_reqs]
    assert not so.scheduled_new_reqs  # nothing is admitted in a step that preempted
    assert list(sched.waiting) == [b, c]
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        admitted += [n.req_id for n in so.scheduled_new_reqs]
    assert admitted == ["a", "b", "b", "c"]
    run_all(sched, runner)


def test_running_request_preempts_itself_when_alone_blocked():
    # a (admitted first) keeps priority: b is preempted, never a.
    sched, runner = make_sched(blocks=5, max_len=64), FakeRunner()
    a, b = make_req("a", 4, max_tokens=9), make_req("b", 4, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    while sched.has_unfinished_requests():
        step(sched, runner)
        assert a.num_preemptions == 0
    assert b.num_preemptions >= 1
    assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)
    run_all(sched, runner)


def test_request_outgrowing_the_cache_is_length_capped():
    sched, runner = make_sched(blocks=3, max_len=64), FakeRunner()  # 8 tokens of KV
    r = make_req("a", 6, max_tokens=20)
    sched.add_request(r)
    run_all(sched, runner)
    assert r.finish_reason == "length" and r.num_tokens == 9 and r.max_tokens == 3


def test_abort_frees_blocks_at_once():
    sched, runner = make_sched(seqs=1), FakeRunner()
    a, b = make_req("a", 9, max_tokens=10), make_req("b", 3, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.block_pool.num_free_blocks == 63 - 3
    aborted = sched.abort_requests(["a", "b", "nope"])
    assert aborted == [a, b] and sched.block_pool.is_whole() and a.block_ids == []
    assert a.finish_reason == b.finish_reason == "abort" and a.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and sched.has_finished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty  # b never reached the runner
    runner.execute(so)
    assert not runner.slots
    assert sched.abort_requests("a") == []


def test_abort_between_schedule_and_update_ignores_sample():
    sched, runner = make_sched(), FakeRunner()
    a = make_req("a", 4)
    sched.add_request(a)
    so = sched.schedule()
    mro = runner.execute(so)
    sched.abort_requests("a")
    assert sched.update_from_output(so, mro) == [] and a.output_token_ids == []
    assert sched.block_pool.is_whole()
    runner.execute(sched.schedule())
    assert not runner.slots


# Finish reasons, through Request.check_stop and end to end.

def _check(outputs: list[int], max_len: int = 100, prompt_len: int = 3, **sp) -> Request:
    r = Request("x", list(range(1, prompt_len + 1)), SamplingParams(**sp), eos_token_ids=(EOS,), max_model_len=max_len)
    for t in outputs:
        assert not r.is_finished
        r.append_output_token(t)
        r.check_stop(max_len)
    return r


def test_finish_reasons():
    r = _check([5, 6, EOS], max_tokens=10)
    assert r.finish_reason == "stop" and r.stop_reason is None and r.status == RequestStatus.FINISHED_STOPPED
    r = _check([5, 42], max_tokens=10, stop_token_ids=[42, 43])
    assert r.finish_reason == "stop" and r.stop_reason == 42
    r = _check([5, 6, 7], max_tokens=3)
    assert r.finish_reason == "length" and r.stop_reason is None
    r = _check([5, 6, EOS, 7], max_tokens=4, ignore_eos=True)
    assert r.finish_reason == "length" and r.num_output_tokens == 4
    r = _check([EOS, 42, 9, EOS], max_tokens=10, min_tokens=3, stop_token_ids=[42])
    assert r.finish_reason == "stop" and r.num_output_tokens == 4
    r = _check([5, 6], max_len=5, max_tokens=None)
    assert r.finish_reason == "length" and r.num_tokens == 5 and r.max_tokens == 2
    r = _check([5, EOS], max_tokens=2)  # the last token is EOS: stop wins over length
    assert r.finish_reason == "stop"
    assert _check([5], max_tokens=3).finish_reason is None
    assert RequestStatus.FINISHED_ABORTED.is_finished and not RequestStatus.PREEMPTED.is_finished


def test_finish_reasons_end_to_end():
    sched = make_sched(max_len=20)
    runner = FakeRunner(token_fn=lambda rid, pos: {"eos": EOS, "stop": 77}.get(rid, 100) if pos >= 6 else 100)
    reqs = {
        "eos": make_req("eos", 4, max_tokens=10),
        "stop": make_req("stop", 4, max_tokens=10, stop_token_ids=[77]),
        "ign": make_req("ign", 4, max_tokens=5, ignore_eos=True),
        "len": make_req("len", 4, max_tokens=None),
    }
    for r in reqs.values():
        sched.add_request(r)
    run_all(sched, runner)
    assert [(r.finish_reason, r.stop_reason, r.num_output_tokens) for r in reqs.values()] == [
        ("stop", None, 3), ("stop", 77, 3), ("length", None, 5), ("length", None, 16)]


def test_validation():
    with pytest.raises(ValueError, match="prompt"):
        validate_prompt_length([], 16)
    with pytest.raises(ValueError, match="max_model_len"):
        validate_prompt_length(list(range(16)), 16)
    validate_prompt_length(list(range(15)), 16)
    sched = make_sched(blocks=5, max_len=64)  # 16 tokens of KV
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(make_req("e", 0))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_req("long", 64))
    with pytest.raises(ValueError, match="KV cache blocks"):
        sched.add_request(make_req("big", 17))
    sched.add_request(make_req("ok", 16))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("ok", 3))


@pytest.mark.parametrize("depth", [1, 2], ids=["serial", "async"])
@pytest.mark.parametrize("seed,chunked", [(0, True), (1, True), (2, False), (3, True), (4, False)])
def test_randomized_stress(seed: int, chunked: bool, depth: int):
    """Random arrivals, aborts and preemptions; `depth` steps in flight (2: async scheduling,
    where each step's output is processed only after the next step is scheduled)."""
    rng = random.Random(seed)
    max_len, budget, seqs = 40, 40 if not chunked else 12, 5
    sched = make_sched(seqs=seqs, budget=budget, chunked=chunked, blocks=13, max_len=max_len)
    usable = sched.block_pool.num_usable_blocks
    # Vocab of 40 with EOS = 0: some requests stop early.
    runner = FakeRunner(token_fn=lambda rid, pos: random.Random(f"{seed}:{rid}:{pos}").randrange(40))
    finished: list[Request] = []
    added: list[Request] = []
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for it in range(2000):
        if it < 450 and rng.random() < 0.15:
            for _ in range(rng.randint(1, 3)):
                plen = rng.randint(1, min(max_len - 1, usable * BS))
                r = make_req(f"s{len(added)}", plen, max_tokens=rng.choice([None, 1, 3, 10, 30]),
                             min_tokens=0, ignore_eos=rng.random() < 0.3)
                sched.add_request(r)
                added.append(r)
        if sched.requests and rng.random() < 0.05:
            finished += sched.abort_requests([rng.choice(list(sched.requests))])

        preemptions = sched.num_preemptions
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= budget
        assert sched.num_preemptions == preemptions or not so.scheduled_new_reqs
        assert len(sched.running) <= seqs
        owned = [b for r in added for b in r.block_ids]  # running, draining (finished, step in flight)
        assert len(owned) == len(set(owned)) and NULL_BLOCK_ID not in owned
        assert len(owned) + sched.block_pool.num_free_blocks == usable
        for r in sched.running:
            assert r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders <= max_len
            assert r.num_tokens < max_len
            assert len(r.block_ids) == -(-r.num_computed_tokens // BS)
        for r in sched.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0
        if not chunked:
            for nr in so.scheduled_new_reqs:
                assert so.num_scheduled_tokens[nr.req_id] == len(nr.all_token_ids)
        in_flight.append((so, runner.execute(so)))
        while len(in_flight) >= depth:
            updated = sched.update_from_output(*in_flight.popleft())
            finished += [r for r in updated if r.is_finished]
        for r in sched.running:  # the runner's own view matches the scheduler's (plus the tokens in flight)
            slot = runner.slots[r.req_id]
            assert slot.tokens == r.all_token_ids + slot.tokens[r.num_tokens:]
            assert len(slot.tokens) == r.num_tokens + r.num_output_placeholders
            assert slot.blocks == r.block_ids and slot.computed == r.num_computed_tokens
        if it >= 450 and not sched.has_unfinished_requests():
            while in_flight:  # steps of requests that finished while they were in flight
                assert not sched.update_from_output(*in_flight.popleft())
            break
    assert not sched.has_unfinished_requests()
    runner.execute(sched.schedule())
    assert not runner.slots and sched.block_pool.is_whole() and not sched.requests
    assert len(finished) == len(added) == len({r.req_id for r in finished})
    assert sched.num_preemptions > 0
    for r in finished:
        assert r.num_output_placeholders == 0 and r.num_steps_in_flight == 0
        assert r.output_token_ids == [runner.token_fn(r.req_id, r.num_prompt_tokens + i)
                                      for i in range(r.num_output_tokens)]
        assert r.num_tokens <= max_len
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens
        elif r.finish_reason == "stop":
            assert r.output_token_ids[-1] == EOS and not r.sampling_params.ignore_eos
        else:
            assert r.finish_reason == "abort"
        if r.finish_reason != "abort" and not r.sampling_params.ignore_eos:
            assert EOS not in r.output_token_ids[:-1]


def launch(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    """Schedule and execute a step whose output the host has not processed yet (async)."""
    so = sched.schedule()
    return so, runner.execute(so)


def test_async_schedules_from_placeholders():
    sched, runner = make_sched(budget=8), FakeRunner()
    a, b = make_req("a", 5, max_tokens=10), make_req("b", 6, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    s0 = launch(sched, runner)  # a's prompt and 3 tokens of b's: only a samples
    assert s0[0].num_scheduled_tokens == {"a": 5, "b": 3} and s0[0].sampled_req_ids == {"a"}
    assert (a.num_output_placeholders, b.num_output_placeholders) == (1, 0)
    s1 = launch(sched, runner)  # before step 0's ids arrive: a decodes its placeholder, b finishes its prompt
    assert s1[0].num_scheduled_tokens == {"a": 1, "b": 3} and s1[0].sampled_req_ids == {"a", "b"}
    assert a.num_output_placeholders == 2 and a.num_computed_tokens == 6 and a.num_output_tokens == 0
    sched.update_from_output(*s0)
    assert a.output_token_ids == expected_output(a) and a.num_output_placeholders == 1
    sched.update_from_output(*s1)
    assert a.num_output_tokens == 2 and b.num_output_tokens == 1 and a.num_output_placeholders == 0
    assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)


def test_async_stop_on_arrival_discards_the_token_past_it():
    # "a" samples EOS as its second output token; the step after it is already in flight.
    runner = FakeRunner(token_fn=lambda rid, pos: EOS if pos == 6 else 100 + pos)
    sched = make_sched()
    a = make_req("a", 5, max_tokens=10)
    sched.add_request(a)
    s0, s1 = launch(sched, runner), launch(sched, runner)
    sched.update_from_output(*s0)
    s2 = launch(sched, runner)  # schedules the decode of the EOS token: a's stop is not known yet
    assert "a" in s2[0].num_scheduled_tokens
    (updated,) = sched.update_from_output(*s1)
    assert updated is a and a.finish_reason == "stop" and a.output_token_ids == [105, EOS]
    assert a.block_ids and not sched.block_pool.is_whole()  # step 2 still writes a's KV
    assert sched.update_from_output(*s2) == []  # the token past the stop is never emitted
    assert a.output_token_ids == [105, EOS] and not a.block_ids and sched.block_pool.is_whole()
    assert sched.schedule().finished_req_ids == {"a"}


def test_async_does_not_schedule_past_max_tokens():
    sched, runner = make_sched(), FakeRunner()
    a = make_req("a", 3, max_tokens=2)
    sched.add_request(a)
    s0, s1 = launch(sched, runner), launch(sched, runner)
    assert a.num_output_placeholders == 2
    s2 = launch(sched, runner)  # two tokens in flight already reach max_tokens
    assert s2[0].is_empty
    sched.update_from_output(*s0)
    sched.update_from_output(*s1)
    assert a.finish_reason == "length" and a.output_token_ids == expected_output(a) and sched.block_pool.is_whole()


def test_async_abort_in_flight_frees_blocks_when_the_step_completes():
    sched, runner = make_sched(), FakeRunner()
    a = make_req("a", 9, max_tokens=10)
    sched.add_request(a)
    s0 = launch(sched, runner)
    held = list(a.block_ids)
    assert sched.abort_requests("a") == [a] and a.finish_reason == "abort"
    assert a.block_ids == held and sched.block_pool.num_free_blocks == sched.block_pool.num_usable_blocks - 3
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("a", 3))  # the id is busy until its step completes
    assert sched.update_from_output(*s0) == [] and a.output_token_ids == []
    assert not a.block_ids and sched.block_pool.is_whole()


def test_async_preempted_request_keeps_its_in_flight_token():
    # 4 usable blocks of 4 tokens: "b" (admitted last) is preempted when "a" needs a block.
    sched, runner = make_sched(blocks=5, max_len=32), FakeRunner()
    a, b = make_req("a", 8, max_tokens=10), make_req("b", 8, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    s0 = launch(sched, runner)  # both prompts fill 4 blocks; both sample
    s1 = launch(sched, runner)  # a's placeholder needs a 5th block: b is preempted, its token in flight
    assert b.status == RequestStatus.PREEMPTED and b.num_steps_in_flight == 1 and s1[0].num_scheduled_tokens == {"a": 1}
    sched.update_from_output(*s0)
    assert b.output_token_ids == expected_output(b) and b.num_output_tokens == 1  # kept while waiting
    sched.update_from_output(*s1)
    assert sched.schedule().scheduled_new_reqs == []  # no blocks yet; b waits for a


@pytest.mark.parametrize("correct", [3, 1, 0])
def test_drafts_are_verified_in_one_step(correct: int):
    """A decode step carries 1 + k tokens; the accepted drafts and one more come back."""
    sched, runner = make_sched(), FakeRunner()
    a = make_req("a", 6, max_tokens=10)
    sched.add_request(a)
    step(sched, runner)
    truth = [token_fn("a", 7 + i) for i in range(3)]
    a_drafts = truth[:correct] + [1] * (3 - correct)  # wrong after `correct`
    a.spec_token_ids = list(a_drafts)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {"a": a_drafts}
    assert a.num_output_tokens == 1 + correct + 1 and a.output_token_ids == expected_output(a)
    assert a.num_computed_tokens == a.num_tokens - 1 and a.spec_token_ids == []
    assert len(a.block_ids) * BS >= a.num_computed_tokens
    run_all(sched, runner)
    assert a.output_token_ids == expected_output(a) and a.num_output_tokens == 10


def test_drafts_are_cut_to_max_tokens_and_stop_on_eos():
    sched = make_sched()
    runner = FakeRunner(token_fn=lambda rid, pos: EOS if pos == 8 else 100 + pos)
    a, b = make_req("a", 6, max_tokens=3, ignore_eos=True), make_req("b", 6, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    a.spec_token_ids = [107, EOS, 109, 110]  # all correct, but a may emit only 2 more tokens
    b.spec_token_ids = [107, EOS, 109, 110]  # EOS at position 8 ends b mid-step
    so, updated = step(sched, runner)
    assert so.scheduled_spec_decode_tokens == {"a": [107], "b": [107, EOS, 109, 110]}
    assert a.finish_reason == "length" and a.output_token_ids == [106, 107, EOS]
    assert b.finish_reason == "stop" and b.output_token_ids == [106, 107, EOS]
    run_all(sched, runner)

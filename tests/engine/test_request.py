"""Request.check_stop: every EOS id is EOS, ignore_eos ignores them all, stop tokens still stop."""

from __future__ import annotations

from mrv2.engine.request import Request, RequestStatus
from mrv2.sampling_params import SamplingParams

EOS, EOT = 2, 9  # a primary and a secondary EOS id (Llama 3's <|end_of_text|>, <|eot_id|>)


def _run(outputs: list[int], **sp) -> Request:
    r = Request("x", [1, 3, 4], SamplingParams(**sp), eos_token_ids=(EOS, EOT), max_model_len=100)
    for t in outputs:
        assert not r.is_finished
        r.append_output_token(t)
        r.check_stop()
    return r


def test_secondary_eos_stops_as_eos():
    r = _run([5, EOT], max_tokens=10)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None and r.num_output_tokens == 2


def test_ignore_eos_ignores_every_eos_id():
    r = _run([EOS, EOT, 5, EOT], max_tokens=4, ignore_eos=True)
    assert r.finish_reason == "length" and r.num_output_tokens == 4


def test_user_stop_tokens_stop_under_ignore_eos():
    r = _run([EOT, 42], max_tokens=10, ignore_eos=True, stop_token_ids=[42])
    assert r.finish_reason == "stop" and r.stop_reason == 42
    r = _run([5, EOT], max_tokens=10, ignore_eos=True, stop_token_ids=[EOT])  # asked for explicitly: stops
    assert r.finish_reason == "stop" and r.stop_reason == EOT


def test_min_tokens_defers_every_eos_id():
    r = _run([EOT, EOS, EOT], max_tokens=10, min_tokens=3)
    assert r.finish_reason == "stop" and r.num_output_tokens == 3

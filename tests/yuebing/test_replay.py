import pytest

from yuebing.replay import prompt_tokens
from yuebing.trace import TraceRequest


def test_equal_hash_ids_give_equal_token_blocks():
    a = prompt_tokens(TraceRequest(0, 300, 1, (7, 8, 9)), block_tokens=128)
    b = prompt_tokens(TraceRequest(0, 256, 1, (7, 8)), block_tokens=128)
    c = prompt_tokens(TraceRequest(0, 256, 1, (7, 5)), block_tokens=128)
    assert len(a) == 300 and len(b) == 256
    assert a[:256] == b  # shared prefix, token for token
    assert c[:128] == b[:128] and c[128:] != b[128:]
    assert all(32 <= t < 127 for t in a)


def test_the_salt_gives_fresh_prompts_with_the_same_sharing():
    r1, r2 = TraceRequest(0, 256, 1, (1, 2)), TraceRequest(0, 256, 1, (1, 3))
    assert prompt_tokens(r1, 128, salt=1) != prompt_tokens(r1, 128, salt=2)
    assert prompt_tokens(r1, 128, salt=2)[:128] == prompt_tokens(r2, 128, salt=2)[:128]


def test_fidelity_pairs_plot_is_a_png(tmp_path):
    from yuebing.metrics import Outcome
    from yuebing.replay import Fidelity, plot_pairs

    def outcome(ttft: float, tbt: float) -> Outcome:
        return Outcome(0.0, 100, 10, 1.0, 1.0, ttft_s=ttft, tbt_mean_s=tbt)

    f = Fidelity({}, [outcome(0.3, 0.010), outcome(0.5, 0.012)], [outcome(0.25, 0.009), outcome(0.6, 0.011)])
    path = plot_pairs(f, str(tmp_path / "pairs.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_live_decode_gaps_are_grouped_by_streams_decoding_and_prefill_waiting():
    from yuebing.metrics import Outcome
    from yuebing.replay import decode_gaps, decode_gaps_by_load

    a = Outcome(0.0, 100, 4, 1.0, 1.0, sent_at=0.0, token_times=[1.0, 1.1, 1.3, 1.4])
    b = Outcome(0.0, 100, 3, 1.0, 1.0, sent_at=1.15, token_times=[1.25, 1.35, 1.45])
    groups = decode_gaps_by_load(decode_gaps([a, b]))
    # a's 1.1-1.3 gap: a alone decoding, b waiting for its first token; a's 1.3-1.4 and
    # b's 1.35-1.45: both decoding, nobody waiting. (The 1.0-1.1 hand-off is left out.)
    assert groups.keys() == {"1/prefill", "2/idle"}
    assert groups["1/prefill"]["gaps"] == 1 and groups["1/prefill"]["mean_ms"] == pytest.approx(200)
    assert groups["2/idle"]["gaps"] == 2 and groups["2/idle"]["mean_ms"] == pytest.approx(100)


def test_decode_slowdown_beside_prefill_is_weighted_over_batch_sizes_with_enough_gaps():
    from yuebing.replay import burst_decode_slowdown

    groups = {
        "1/idle": {"gaps": 40, "mean_ms": 10.0}, "1/prefill": {"gaps": 100, "mean_ms": 12.0},  # +20 %
        "2/idle": {"gaps": 30, "mean_ms": 10.0}, "2/prefill": {"gaps": 300, "mean_ms": 14.0},  # +40 %
        "3/idle": {"gaps": 5, "mean_ms": 10.0}, "3/prefill": {"gaps": 500, "mean_ms": 30.0},  # too few idle gaps
    }
    assert burst_decode_slowdown(groups) == pytest.approx((100 * 0.2 + 300 * 0.4) / 400)
    assert burst_decode_slowdown({"1/prefill": {"gaps": 100, "mean_ms": 12.0}}) is None  # nothing to set it against

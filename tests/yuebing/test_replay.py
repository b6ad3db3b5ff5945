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

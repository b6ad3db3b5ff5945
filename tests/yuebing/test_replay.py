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

import json

import pytest

from shared.predictor import Predictor, Row, fit, load_predictor, mape, read_rows
from yuebing.lab.data import GPU_PROFILE


def test_fit_recovers_the_terms_of_a_known_curve():
    truth = Predictor(prefill_coef=(2.0, 0.01, 1e-6, 2e-6), decode_coef=(5.0, 0.1, 1e-4))
    rows = [Row("prefill", n, p, 1, n + p, truth.prefill_s(n, p) * 1e3) for n in (64, 256, 1024, 4096) for p in (0, 512, 2048)]
    rows += [Row("decode", 1, c, b, c, truth.decode_step_s(b, b * c) * 1e3) for b in (1, 4, 16) for c in (128, 1024)]
    fitted = Predictor(fit(rows, "prefill"), fit(rows, "decode"))
    assert mape(fitted, rows) < 0.01


def test_too_few_rows_is_an_error():
    with pytest.raises(ValueError, match="at least 4"):
        fit([Row("decode", 1, 1, 1, 1, 1.0)], "decode")


def test_gpu_profile_fits_within_15_percent():
    p = load_predictor(GPU_PROFILE, "llama3-8b")
    rows = read_rows(GPU_PROFILE, "llama3-8b")
    assert mape(p, [r for r in rows if r.phase == "prefill"]) < 15
    assert p.prefill_s(8192) > p.prefill_s(1024, 7168)  # a cached prefix saves time


def test_shipped_default_profile_loads():
    from shared.config import DEFAULT_PROFILE

    data = json.loads(DEFAULT_PROFILE.read_text())
    assert data["meta"]["kv_bytes_per_token"] > 0
    p = load_predictor(DEFAULT_PROFILE)
    assert 0 < p.prefill_s(128) < p.prefill_s(2048)
    assert 0 < p.decode_step_s(1, 512) <= p.decode_step_s(16, 16 * 512)


def test_default_slos_are_multiples_of_a_lone_full_context_request():
    from shared.config import DEFAULT_PROFILE
    from shared.predictor import TBT_SLO_FACTOR, TTFT_SLO_FACTOR, default_slos_ms, load_predictor

    p = load_predictor(DEFAULT_PROFILE)
    ttft, tbt = default_slos_ms(p, 4096)
    assert abs(ttft - TTFT_SLO_FACTOR * p.prefill_s(4096) * 1e3) < 0.1
    assert abs(tbt - TBT_SLO_FACTOR * p.decode_step_s(1, 4096) * 1e3) < 0.1
    assert default_slos_ms(p, 1024)[0] < ttft  # a shorter context, a tighter TTFT


def test_a_decode_engines_chunk_keeps_the_tbt_slo_beside_a_busy_batch_in_whole_blocks():
    from shared.config import DEFAULT_PROFILE
    from shared.predictor import CHUNK_BATCH, default_decode_chunk_tokens, mixed_step_s

    p = load_predictor(DEFAULT_PROFILE)
    chunk = default_decode_chunk_tokens(p, 0.05, 2048, 2048, 16)
    assert chunk % 16 == 0 and 16 <= chunk <= 2048
    assert mixed_step_s(p, CHUNK_BATCH, CHUNK_BATCH * 1024, [(chunk, 0)]) <= 0.05
    assert mixed_step_s(p, CHUNK_BATCH, CHUNK_BATCH * 1024, [(chunk + 16, 0)]) > 0.05
    assert default_decode_chunk_tokens(p, 10.0, 2048, 2048, 16) == 2048  # never above the step's budget
    assert default_decode_chunk_tokens(p, 10.0, 1024, 2048, 16) == 1024  # ... nor the model's context
    assert default_decode_chunk_tokens(p, 1e-6, 2048, 2048, 16) >= 16  # a block at the least


# prefill: 5 ms a step + 1 ms a token; decode: 10 ms a step + 1 ms a sequence
STEPS = Predictor(prefill_coef=(5.0, 1.0, 0.0, 0.0), decode_coef=(10.0, 1.0, 0.0))


def test_a_mixed_step_is_the_decode_step_plus_the_chunks_marginal_cost():
    from shared.predictor import mixed_step_s

    # The step's fixed cost once (the decode's 10 ms), not the prefill's 5 ms again.
    assert mixed_step_s(STEPS, 2, 2000, [(100, 0), (50, 512)]) == pytest.approx(0.012 + 0.150)
    assert mixed_step_s(STEPS, 2, 2000, []) == pytest.approx(STEPS.decode_step_s(2, 2000))
    # Without a batch it is a plain prefill step; with neither, nothing.
    assert mixed_step_s(STEPS, 0, 0, [(100, 0)]) == pytest.approx(STEPS.prefill_step_s([(100, 0)]))
    assert mixed_step_s(STEPS, 0, 0, []) == 0.0

"""Chunked pipeline-parallel prefill (services/conductor/cpp.py): what stages buy a
long prompt and cost a short one, the hand-over, and prompts overlapping in a group."""

import pytest

from services.conductor.cpp import (
    PipelineGroup,
    chunked_prefill_s,
    chunks,
    pipeline_prefill_s,
    run_pipeline,
    stage_s,
)
from shared.predictor import Predictor

# prefill(n, p) ms = 10 + 0.02·n + 2e-6·n·p + 1e-6·n²: a fixed cost, linear layers, attention
PRED = Predictor(prefill_coef=(10.0, 0.02, 2e-6, 1e-6), decode_coef=(1.0, 1.0, 0.0))
CHUNK = 4096


def test_a_one_chunk_prompt_gains_nothing_from_stages():
    single = chunked_prefill_s(PRED, 2000, 0, CHUNK)
    for stages in (2, 4, 8):
        free = pipeline_prefill_s(PRED, PipelineGroup(stages, CHUNK), 2000)
        paid = pipeline_prefill_s(PRED, PipelineGroup(stages, CHUNK, 8192, 25e9), 2000)
        # the chunk walks the stages one after another: every stage's fixed cost is extra
        assert free == pytest.approx(single + (stages - 1) * PRED.prefill_coef[0] / 1e3)
        assert paid > free > single


def test_a_long_prompt_on_s_stages_takes_a_sth_of_the_single_time_plus_the_fill():
    tokens = 64 * 1024
    single = chunked_prefill_s(PRED, tokens, 0, CHUNK)
    steps = chunks(tokens, 0, CHUNK)
    fixed = PRED.prefill_coef[0] / 1e3
    for stages in (2, 4, 8):
        took = pipeline_prefill_s(PRED, PipelineGroup(stages, CHUNK), tokens)
        fill = (stages - 1) * max(stage_s(PRED, n, p, stages) for n, p in steps) + len(steps) * fixed
        assert single / stages <= took <= single / stages + fill
        assert took < single / 1.5  # the point of CPP: it is much faster than one instance


def test_the_hand_over_adds_time_in_proportion_to_its_bytes():
    tokens, stages, link = 3000, 4, 10e9
    base = pipeline_prefill_s(PRED, PipelineGroup(stages, CHUNK, 0, link), tokens)
    extra = [pipeline_prefill_s(PRED, PipelineGroup(stages, CHUNK, b, link), tokens) - base for b in (4096, 8192)]
    assert extra[0] == pytest.approx((stages - 1) * tokens * 4096 / link)
    assert extra[1] == pytest.approx(2 * extra[0])


def test_a_second_prompt_starts_on_stage_0_before_the_first_leaves_the_last_stage():
    group = PipelineGroup(4, CHUNK, 8192, 25e9)
    first = run_pipeline(PRED, group, 32 * 1024, 0, (0.0,) * 4)
    second = run_pipeline(PRED, group, 32 * 1024, 0, first)
    assert first[0] < first[-1]  # stage 0 is free while the last stage still works
    # so the second overlaps the first's drain: it ends sooner than after it
    assert second[-1] < first[-1] + pipeline_prefill_s(PRED, group, 32 * 1024)
    assert all(b > a for a, b in zip(first, second))


def test_an_invalid_group_is_refused():
    with pytest.raises(ValueError):
        PipelineGroup(0, CHUNK)
    with pytest.raises(ValueError):
        PipelineGroup(2, 0)
    with pytest.raises(ValueError):
        run_pipeline(PRED, PipelineGroup(2, CHUNK), 1000, 0, (0.0,) * 3)

"""lm-evaluation-harness through the cluster gives what it gives through `vllm serve`
on the real model (SmolLM2-135M-Instruct, tests/layouts.py) in the same dtype: a
log-likelihood task over `local-completions` (echoed prompts with their logprobs), on
which the model scores above chance, and a generation task over
`local-chat-completions`, both shipped in tests/e2e/evaluation/. Equal scores, and
equal per-sample answers, test the logprobs and the text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

CHANCE = 0.25  # four choices a question
DATA = Path(__file__).parent / "evaluation"
TOLERANCE = 1e-4
TASKS = {
    "yuebing_choice": """\
task: yuebing_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}/choice.jsonl"}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc}}]
""",
    "yuebing_generate": """\
task: yuebing_generate
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}/generate.jsonl"}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n\\n"], max_gen_toks: 16, temperature: 0, do_sample: false}}
metric_list: [{{metric: exact_match}}]
""",
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    for name, text in TASKS.items():
        (folder / f"{name}.yaml").write_text(text.format(data=DATA))
    return folder


def evaluate(api: str, model_dir: Path, tasks: Path, task: str, chat: bool) -> dict:
    """lm-eval's scores and per-sample answers for one task against one server."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    endpoint = "chat/completions" if chat else "completions"
    args = {"model": model_dir.name, "base_url": f"{api}/{endpoint}", "tokenizer": str(model_dir), "num_concurrent": 1,
            "max_retries": 1, "tokenizer_backend": "huggingface", "tokenized_requests": False, "timeout": 120}
    out = lm_eval.simple_evaluate(
        model="local-chat-completions" if chat else "local-completions",
        model_args=",".join(f"{k}={v}" for k, v in args.items()), tasks=[task],
        task_manager=TaskManager(include_path=str(tasks)), log_samples=True, apply_chat_template=chat,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )
    return {"scores": out["results"][task], "answers": [s["resps"] for s in out["samples"][task]]}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def test_a_log_likelihood_task_scores_above_chance_as_through_vllm_serve(real_model, real_vllm_serve, real_model_dir,
                                                                         tasks):
    ours = evaluate(real_model.api, real_model_dir, tasks, "yuebing_choice", chat=False)
    plain = evaluate(real_vllm_serve, real_model_dir, tasks, "yuebing_choice", chat=False)
    assert ours["scores"] == plain["scores"], json.dumps([ours["scores"], plain["scores"]])
    assert ours["scores"]["acc,none"] > CHANCE
    # Each answer: (log-likelihood, whether it is the greedy continuation), per choice.
    for got, want in zip(ours["answers"], plain["answers"], strict=True):
        assert [r[0][0] for r in got] == pytest.approx([r[0][0] for r in want], abs=TOLERANCE)
        assert [r[0][1] for r in got] == [r[0][1] for r in want]


def test_a_generation_task_scores_as_through_vllm_serve(real_model, real_vllm_serve, real_model_dir, tasks):
    ours = evaluate(real_model.api, real_model_dir, tasks, "yuebing_generate", chat=True)
    plain = evaluate(real_vllm_serve, real_model_dir, tasks, "yuebing_generate", chat=True)
    assert ours == plain

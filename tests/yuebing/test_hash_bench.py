import json
import random

import pytest

from yuebing import cli
from yuebing.bench.hash import BASELINE, CHOSEN, HashBench, hash_case, load_tokenizer, prompt_text, run, table
from yuebing.model import default_model_dir


def test_hash_case_times_both_digests_on_the_same_blocks():
    case = hash_case(list(range(1000)), 128, repeats=3)
    assert case["blocks"] == 7 and set(case["us"]) == {BASELINE, CHOSEN}
    assert all(t > 0 for t in case["us"].values())
    assert case["ratio"] == pytest.approx(case["us"][CHOSEN] / case["us"][BASELINE])
    assert case["extra_us"] == pytest.approx(case["us"][CHOSEN] - case["us"][BASELINE])


def test_without_a_tokenizer_there_is_no_gateway_share():
    result = run(HashBench(prompt_tokens=(512, 2048), block_sizes=(128, 16), repeats=1, tokenizer=""))
    assert [(r["prompt_tokens"], r["block_size"]) for r in result["results"]] == [
        (512, 128), (512, 16), (2048, 128), (2048, 16)]
    assert all(r["gateway_us"] is None and r["share"] is None for r in result["results"])
    lines = table(result).splitlines()
    assert len(lines) == 2 + 4 and lines[-1].split()[-2:] == ["-", "-"]


def test_a_missing_tokenizer_folder_is_skipped(tmp_path):
    assert load_tokenizer(str(tmp_path / "absent")) is None and load_tokenizer("") is None


@pytest.mark.skipif(not (default_model_dir() / "tokenizer.json").exists(), reason="no model (yuebing model init)")
def test_the_gateway_share_is_measured_with_the_model_tokenizer(tmp_path):
    tokenizer = load_tokenizer(str(default_model_dir()))
    assert len(tokenizer.encode(prompt_text(tokenizer, 300, random.Random(0)), add_special_tokens=False)) in range(
        295, 306)  # cut at token 300; decoding and encoding again may merge a few
    out = tmp_path / "h.json"
    assert cli.main(["bench", "hash", "--prompt-tokens", "256", "--block-sizes", "16", "--repeats", "1",
                     "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["gateway_us"] > 0 and r["share"] == pytest.approx(r["extra_us"] / (r["gateway_us"] + r["us"][BASELINE]))

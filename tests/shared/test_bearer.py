"""The one Bearer-key check every HTTP page uses (odd header bytes: tests/gateway/test_edge.py)."""

from aiohttp.test_utils import make_mocked_request

from shared.bearer import bearer_matches


def test_only_the_exact_bearer_key_matches():
    def asked(header: str | None) -> bool:
        headers = {"Authorization": header} if header is not None else {}
        return bearer_matches(make_mocked_request("GET", "/metrics", headers=headers), "s3cret")

    assert asked("Bearer s3cret")
    assert not asked(None) and not asked("Bearer s3cre") and not asked("bearer s3cret") and not asked("s3cret")

"""shared/nats_jwt.py: nkeys and NATS JWTs as NATS reads them (nats-server's own check
is tests/nats_auth/test_app.py's)."""

import pytest

from shared.nats_jwt import PREFIX_USER, KeyPair, crc16, decode, encode


def test_nkeys_say_what_they_are_and_carry_their_checksum():
    account, user = KeyPair.new(), KeyPair.new(PREFIX_USER)
    assert account.seed.startswith("SA") and account.public_key.startswith("A") and len(account.public_key) == 56
    assert user.seed.startswith("SU") and user.public_key.startswith("U")
    assert crc16(b"123456789") == 0x31C3  # CRC-16/XMODEM's check value
    # A character inside the seed (its last one holds padding bits too: changing those changes no byte).
    broken = account.seed[:10] + ("A" if account.seed[10] != "A" else "B") + account.seed[11:]
    with pytest.raises(ValueError, match="checksum"):
        KeyPair(broken).public_key


def test_a_jwt_is_issued_by_its_signer_and_a_changed_one_is_refused():
    signer = KeyPair.new()
    token = encode({"sub": "UABC", "nats": {"type": "user", "version": 2}}, signer)
    claims = decode(token)
    assert claims["iss"] == signer.public_key and claims["sub"] == "UABC" and claims["jti"]
    head, body, signature = token.split(".")
    other = encode({"sub": "UXYZ", "nats": {"type": "user", "version": 2}}, signer).split(".")[1]
    with pytest.raises(ValueError, match="not a valid NATS JWT"):
        decode(f"{head}.{other}.{signature}")

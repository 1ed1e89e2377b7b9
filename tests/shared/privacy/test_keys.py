import pytest

from shared.privacy.errors import ShareDecryptionFailed
from shared.privacy.keys import (
    RoundKeys,
    decrypt_share_payload,
    encrypt_share_payload,
    mask_seed,
    share_encryption_key,
)

BINDING = {"study_uid": "study-a", "round_no": 3, "sender": 1, "receiver": 2}


def _share_key(own: RoundKeys, peer: RoundKeys, *, round_no: int = 3) -> bytes:
    return share_encryption_key(own.cipher, peer.cipher_public(), study_uid="study-a", round_no=round_no, sites=(1, 2))


def test_both_sites_derive_the_same_share_key_and_mask_seed() -> None:
    alice, bob = RoundKeys.generate(), RoundKeys.generate()
    assert _share_key(alice, bob) == _share_key(bob, alice)
    seed_ab = mask_seed(alice.mask, bob.mask_public(), study_uid="s", round_no=1, sites=(1, 2))
    seed_ba = mask_seed(bob.mask, alice.mask_public(), study_uid="s", round_no=1, sites=(2, 1))
    assert seed_ab == seed_ba and len(seed_ab) == 32


def test_derived_keys_differ_by_round_purpose_and_pair() -> None:
    alice, bob = RoundKeys.generate(), RoundKeys.generate()
    share_key = _share_key(alice, bob)
    assert share_key != _share_key(alice, bob, round_no=4)
    assert share_key != mask_seed(alice.cipher, bob.cipher_public(), study_uid="study-a", round_no=3, sites=(1, 2))
    other_pair = share_encryption_key(alice.cipher, bob.cipher_public(), study_uid="study-a", round_no=3, sites=(1, 3))
    assert share_key != other_pair


def test_share_ciphertext_round_trips_under_its_binding() -> None:
    key = _share_key(RoundKeys.generate(), RoundKeys.generate())
    ciphertext = encrypt_share_payload(key, b"shares", **BINDING)
    assert b"shares" not in ciphertext
    assert decrypt_share_payload(key, ciphertext, **BINDING) == b"shares"


@pytest.mark.parametrize(
    "changed",
    [
        {"study_uid": "study-b"},
        {"round_no": 4},
        {"sender": 2, "receiver": 1},  # the same pair, the other direction
        {"receiver": 3},
    ],
)
def test_share_ciphertext_with_wrong_associated_data_fails(changed: dict[str, object]) -> None:
    key = _share_key(RoundKeys.generate(), RoundKeys.generate())
    ciphertext = encrypt_share_payload(key, b"shares", **BINDING)
    with pytest.raises(ShareDecryptionFailed):
        decrypt_share_payload(key, ciphertext, **{**BINDING, **changed})  # type: ignore[arg-type]


def test_share_ciphertext_tampered_or_under_another_key_fails() -> None:
    key = _share_key(RoundKeys.generate(), RoundKeys.generate())
    ciphertext = bytearray(encrypt_share_payload(key, b"shares", **BINDING))
    ciphertext[-1] ^= 1
    with pytest.raises(ShareDecryptionFailed):
        decrypt_share_payload(key, bytes(ciphertext), **BINDING)
    ciphertext[-1] ^= 1
    with pytest.raises(ShareDecryptionFailed):
        decrypt_share_payload(bytes(32), bytes(ciphertext), **BINDING)

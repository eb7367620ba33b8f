"""queue/signing.py: pure logic of the queue's message authentication (HMAC-SHA256, per-run key)."""

from __future__ import annotations

import os
import stat

import pytest
from eopd_trainer.queue.signing import (
    MAGIC,
    Signer,
    Unauthenticated,
    load_key,
    signer_for,
    write_key_file,
)

KEY = b"k" * 32


def test_fields_carry_a_mac_that_binds_payload_scope_and_key():
    s = Signer(KEY)
    f = s.fields("ns:rollouts", b"payload")
    assert f[b"data"] == b"payload" and len(f[b"mac"]) == 32
    assert s.valid("ns:rollouts", b"payload", f[b"mac"])
    assert not s.valid("ns:rollouts", b"payload!", f[b"mac"])  # another payload
    assert not s.valid("ns:tasks", b"payload", f[b"mac"])  # moved to another stream
    assert not s.valid("other:rollouts", b"payload", f[b"mac"])  # another run's namespace
    assert not Signer(b"x" * 32).valid("ns:rollouts", b"payload", f[b"mac"])  # another key
    assert not s.valid("ns:rollouts", b"payload", None)  # no mac field
    assert not s.valid("ns:rollouts", None, f[b"mac"])  # no data field
    assert not s.valid("ns:rollouts", b"payload", f[b"mac"][:-1])  # truncated


def test_seal_and_unseal_of_a_string_value():
    s = Signer(KEY)
    sealed = s.seal("ns:policy", b"announcement")
    assert sealed.startswith(MAGIC) and s.unseal("ns:policy", sealed) == b"announcement"
    with pytest.raises(Unauthenticated, match="no MAC"):
        s.unseal("ns:policy", b"announcement")  # a forged, unsigned value
    with pytest.raises(Unauthenticated, match="wrong MAC"):
        s.unseal("ns:policy", sealed[:-1] + b"X")
    with pytest.raises(Unauthenticated, match="wrong MAC"):
        s.unseal("other:policy", sealed)
    with pytest.raises(Unauthenticated, match="wrong MAC"):
        Signer(b"y" * 32).unseal("ns:policy", sealed)


def test_without_a_key_nothing_is_signed_and_everything_passes():
    s = Signer(None)
    assert not s.enabled
    assert s.fields("ns:tasks", b"d") == {b"data": b"d"}
    assert s.valid("ns:tasks", b"d", None) and s.valid("ns:tasks", None, None)
    assert s.seal("ns:policy", b"p") == b"p" and s.unseal("ns:policy", b"p") == b"p"
    with pytest.raises(Unauthenticated, match="this process has none"):
        s.unseal("ns:policy", Signer(KEY).seal("ns:policy", b"p"))


def test_short_keys_are_refused():
    with pytest.raises(ValueError, match="at least 32"):
        Signer(b"short")


def test_key_file_created_private_and_kept(tmp_path):
    path = write_key_file(tmp_path / "queue.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = load_key(path)
    assert len(key) == 64 and bytes.fromhex(key.decode())
    assert write_key_file(path) == path and load_key(path) == key  # a resume keeps it
    assert signer_for(str(path)).enabled and not signer_for(None).enabled
    (tmp_path / "bad.key").write_text("too short\n")
    with pytest.raises(ValueError, match=r"queue.auth_key_file .*bad.key: 9 bytes, at least 32"):
        load_key(tmp_path / "bad.key")
    with pytest.raises(ValueError, match=r"queue.auth_key_file .*missing.key: cannot read it"):
        signer_for(str(tmp_path / "missing.key"))

"""Block identity: chained prefix keys, fingerprints, the key codec and engine-hash keys."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_client.errors import KeyFormatError
from kvpool_client.keys import (
    DIGEST_BYTES,
    FINGERPRINT_BYTES,
    RAW_KEY_BYTES,
    BlockKey,
    ModelFingerprint,
    block_keys,
    chain_seed,
    key_from_engine_hash,
    next_digest,
)

BT = 4
FP = ModelFingerprint(model="meta-llama/Llama-3-8B", dtype="bfloat16", block_tokens=BT, kv_layout="HND",
                      revision="r1")

tokens_st = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=6 * BT)
full_tokens_st = st.integers(1, 6).flatmap(
    lambda n: st.lists(st.integers(0, 2**32 - 1), min_size=n * BT, max_size=n * BT)
)

#: One changed value per fingerprint field; ``block_tokens`` stays at BT so the token
#: split (and so the number of keys) is the same.
FIELD_CHANGES: list[tuple[str, Any]] = [
    ("model", "meta-llama/Llama-3-70B"),
    ("revision", "r2"),
    ("dtype", "float16"),
    ("kv_layout", "NHD"),
    ("tp_rank", 1),
    ("tp_size", 4),
    ("pp_rank", 1),
    ("lora_id", "adapter-7"),
    ("namespace", "tenant-a"),
    ("extra", {"quant": "fp8"}),
]


def _changed(field: str, value: Any) -> ModelFingerprint:
    kw: dict[str, Any] = {field: value}
    if field == "tp_rank":
        kw["tp_size"] = 2
    if field == "pp_rank":
        kw["pp_size"] = 2
    return dataclasses.replace(FP, **kw)


# ------------------------------------------------------------------------ chaining
@given(tokens_st, tokens_st)
def test_equal_prefixes_give_equal_keys(a: list[int], b: list[int]) -> None:
    ka, kb = block_keys(FP, a), block_keys(FP, b)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared_blocks = common // BT
    assert ka[:shared_blocks] == kb[:shared_blocks]
    # Past the common prefix, a block whose tokens differ has a different key.
    if shared_blocks < min(len(ka), len(kb)):
        assert ka[shared_blocks] != kb[shared_blocks]


@given(full_tokens_st)
def test_keys_are_deterministic_and_distinct_along_a_chain(tokens: list[int]) -> None:
    keys = block_keys(FP, tokens)
    assert keys == block_keys(FP, list(tokens))
    assert len(keys) == len(tokens) // BT
    assert len({k.digest for k in keys}) == len(keys)
    assert all(k.fingerprint == FP.digest() for k in keys)


@pytest.mark.parametrize(("field", "value"), FIELD_CHANGES, ids=[f for f, _ in FIELD_CHANGES])
@settings(max_examples=25)
@given(tokens=full_tokens_st)
def test_changing_any_fingerprint_field_changes_every_key(field: str, value: Any, tokens: list[int]) -> None:
    other = _changed(field, value)
    assert other.digest() != FP.digest()
    base, changed = block_keys(FP, tokens), block_keys(other, tokens)
    assert len(base) == len(changed)
    for k0, k1 in zip(base, changed):
        assert k0 != k1
        assert k0.digest != k1.digest
        assert k0.fingerprint != k1.fingerprint


def test_block_tokens_is_part_of_the_fingerprint() -> None:
    tokens = list(range(16))
    k4 = block_keys(FP, tokens)
    k8 = block_keys(dataclasses.replace(FP, block_tokens=8), tokens)
    assert len(k4) == 4 and len(k8) == 2
    assert FP.digest() != dataclasses.replace(FP, block_tokens=8).digest()
    assert not {k.raw for k in k4} & {k.raw for k in k8}


def test_extra_order_does_not_matter_but_values_do() -> None:
    a = dataclasses.replace(FP, extra={"a": "1", "b": "2"})
    b = dataclasses.replace(FP, extra={"b": "2", "a": "1"})
    c = dataclasses.replace(FP, extra={"a": "1", "b": "3"})
    assert a.digest() == b.digest()
    assert a.digest() != c.digest()


def test_fingerprint_fields_are_unambiguous() -> None:
    # Length prefixes: moving characters between adjacent fields changes the digest.
    a = dataclasses.replace(FP, model="ab", revision="c")
    b = dataclasses.replace(FP, model="a", revision="bc")
    assert a.digest() != b.digest()


@settings(max_examples=50)
@given(data=st.data(), tokens=full_tokens_st)
def test_changing_one_token_changes_keys_from_its_block_on(data: st.DataObject, tokens: list[int]) -> None:
    pos = data.draw(st.integers(0, len(tokens) - 1))
    new = data.draw(st.integers(0, 2**32 - 1).filter(lambda t: t != tokens[pos]))
    changed = list(tokens)
    changed[pos] = new
    j = pos // BT
    before, after = block_keys(FP, tokens), block_keys(FP, changed)
    assert before[:j] == after[:j]
    for i in range(j, len(before)):
        assert before[i] != after[i]


@settings(max_examples=50)
@given(data=st.data(), tokens=full_tokens_st)
def test_extras_change_keys_from_their_block_on(data: st.DataObject, tokens: list[int]) -> None:
    n = len(tokens) // BT
    j = data.draw(st.integers(0, n - 1))
    extra = data.draw(st.one_of(st.binary(max_size=8), st.text(max_size=8), st.integers()))
    plain = block_keys(FP, tokens)
    no_extras = block_keys(FP, tokens, [()] * n)
    assert no_extras == plain
    extras: list[list[Any]] = [[] for _ in range(n)]
    extras[j] = [extra]
    with_extra = block_keys(FP, tokens, extras)
    assert with_extra[:j] == plain[:j]
    for i in range(j, n):
        assert with_extra[i] != plain[i]


def test_extras_of_different_types_do_not_collide() -> None:
    tokens = list(range(BT))
    variants = [[1], ["1"], [b"1"], [b"\x01"], ["a", "b"], ["ab"], [b"a", b"b"], [b"ab"]]
    keys = {block_keys(FP, tokens, [v])[0] for v in variants}
    assert len(keys) == len(variants)


@pytest.mark.parametrize("bad", [True, 1.5, None, ["x"]])
def test_bad_extras_are_rejected(bad: Any) -> None:
    with pytest.raises(KeyFormatError):
        block_keys(FP, list(range(BT)), [[bad]])


@pytest.mark.parametrize("text", [bytes(4 * BT), bytearray(4 * BT), memoryview(bytes(4 * BT)), "t" * BT])
def test_token_ids_given_as_bytes_or_a_string_are_refused(text: Any) -> None:
    """Bytes would be read as machine integers (a key of bytes no tokenizer made), a string
    as characters: neither is a list of token ids."""
    with pytest.raises(KeyFormatError, match="integers"):
        block_keys(FP, text)


def test_extras_must_cover_every_full_block() -> None:
    with pytest.raises(KeyFormatError):
        block_keys(FP, list(range(3 * BT)), [[], []])


@given(tokens_st)
def test_partial_trailing_block_has_no_key(tokens: list[int]) -> None:
    keys = block_keys(FP, tokens)
    assert len(keys) == len(tokens) // BT
    full = tokens[: len(keys) * BT]
    assert keys == block_keys(FP, full)
    # Whatever the partial tail holds, the keys are those of the full blocks.
    assert block_keys(FP, full + [7] * (BT - 1)) == block_keys(FP, full)


@given(full_tokens_st, st.data())
def test_parent_continuation_equals_hashing_the_whole_sequence(tokens: list[int], data: st.DataObject) -> None:
    n = len(tokens) // BT
    split = data.draw(st.integers(1, n))
    whole = block_keys(FP, tokens)
    head = block_keys(FP, tokens[: split * BT])
    tail = block_keys(FP, tokens[split * BT :], parent=head[-1])
    assert head + tail == whole


def test_parent_of_another_fingerprint_is_rejected() -> None:
    other = dataclasses.replace(FP, namespace="x")
    parent = block_keys(other, list(range(BT)))[0]
    with pytest.raises(KeyFormatError):
        block_keys(FP, list(range(BT)), parent=parent)


def test_chain_matches_the_documented_construction() -> None:
    tokens = list(range(2 * BT))
    h0 = next_digest(chain_seed(FP), tokens[:BT])
    h1 = next_digest(h0, tokens[BT:], [b"img"])
    keys = block_keys(FP, tokens, [[], [b"img"]])
    assert [k.digest for k in keys] == [h0, h1]
    assert chain_seed(FP) == chain_seed(FP.digest())
    with pytest.raises(KeyFormatError):
        next_digest(b"short", tokens[:BT])


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, 1.0, "3", None])
def test_bad_tokens_are_rejected(bad: Any) -> None:
    tokens: list[Any] = [1, 2, 3, 4]
    tokens[2] = bad
    with pytest.raises(KeyFormatError):
        block_keys(FP, tokens)


def test_token_bounds_are_inclusive() -> None:
    assert len(block_keys(FP, [0, 2**32 - 1, 0, 2**32 - 1])) == 1


@pytest.mark.parametrize(
    "kw",
    [
        {"model": ""},
        {"dtype": ""},
        {"block_tokens": 0},
        {"block_tokens": -4},
        {"tp_rank": 2, "tp_size": 2},
        {"tp_rank": -1},
        {"pp_rank": 1, "pp_size": 1},
        {"extra": {"k": 1}},
    ],
)
def test_invalid_fingerprints_are_rejected(kw: dict[str, Any]) -> None:
    with pytest.raises(KeyFormatError):
        dataclasses.replace(FP, **kw)


# ------------------------------------------------------------------------ codec
key_st = st.builds(
    BlockKey, st.binary(min_size=FINGERPRINT_BYTES, max_size=FINGERPRINT_BYTES),
    st.binary(min_size=DIGEST_BYTES, max_size=DIGEST_BYTES),
)


@given(key_st)
def test_text_and_raw_round_trip(key: BlockKey) -> None:
    assert BlockKey.parse(key.text) == key
    assert BlockKey.parse(str(key)) == key
    assert key.text.startswith("v1:")
    assert len(key.raw) == RAW_KEY_BYTES
    assert BlockKey.from_raw(key.raw) == key
    assert BlockKey.from_raw(bytearray(key.raw)) == key


GOOD = "v1:" + "ab" * FINGERPRINT_BYTES + ":" + "cd" * DIGEST_BYTES


@pytest.mark.parametrize(
    "text",
    [
        "",
        "v2" + GOOD[2:],
        "V1" + GOOD[2:],
        GOOD[3:],  # no version
        GOOD + ":ff",  # four parts
        GOOD.replace(":", "", 1),  # two parts
        "v1:" + "ab" * (FINGERPRINT_BYTES - 1) + ":" + "cd" * DIGEST_BYTES,
        "v1:" + "ab" * FINGERPRINT_BYTES + ":" + "cd" * (DIGEST_BYTES + 1),
        "v1:" + "ab" * FINGERPRINT_BYTES + ":" + "cd" * DIGEST_BYTES + "c",
        "v1:" + "zz" * FINGERPRINT_BYTES + ":" + "cd" * DIGEST_BYTES,
        "v1:" + "ab" * FINGERPRINT_BYTES + ":" + "cg" * DIGEST_BYTES,
    ],
)
def test_malformed_text_is_rejected(text: str) -> None:
    assert BlockKey.parse(GOOD).text == GOOD  # the template itself is valid
    with pytest.raises(KeyFormatError):
        BlockKey.parse(text)


@pytest.mark.parametrize("n", [0, 1, RAW_KEY_BYTES - 1, RAW_KEY_BYTES + 1, 64])
def test_from_raw_checks_the_length(n: int) -> None:
    with pytest.raises(KeyFormatError):
        BlockKey.from_raw(b"\x00" * n)


def test_block_key_checks_part_lengths() -> None:
    with pytest.raises(KeyFormatError):
        BlockKey(b"\x00" * 15, b"\x00" * 32)
    with pytest.raises(KeyFormatError):
        BlockKey(b"\x00" * 16, b"\x00" * 33)


# ------------------------------------------------------------------------ golden
def test_golden_key_pins_the_hashing_scheme() -> None:
    """Changing the hash, personalisation or canonical encoding breaks every stored key."""
    fp = ModelFingerprint(
        model="meta-llama/Llama-3-8B", dtype="bfloat16", block_tokens=16, revision="main",
        kv_layout="NHD", tp_rank=1, tp_size=2, lora_id="sql-lora", namespace="team-a",
        extra={"quant": "fp8"},
    )
    keys = block_keys(fp, list(range(40)), [[b"image-hash"], ["salt", 7]])
    assert [k.text for k in keys] == GOLDEN


GOLDEN = [
    "v1:1a2d5dbd620577cf37565b4840d232cd:da8752bf662705dff45cc3c2f28de067857aea62f456bc55b4a19150dd3b9f90",
    "v1:1a2d5dbd620577cf37565b4840d232cd:2dd633f526a7ab43ef43e15718fb202320867ec5dee2b442de050578e104fc71",
]


# ------------------------------------------------------------------------ engine hashes
def test_engine_hash_keys_are_namespaced_by_fingerprint_and_scheme() -> None:
    h = bytes(range(32))
    k = key_from_engine_hash(FP, "sha256_cbor", h)
    assert k == key_from_engine_hash(FP, "sha256_cbor", h)
    assert k.fingerprint == FP.digest()
    assert k != key_from_engine_hash(FP, "sglang", h)
    other = dataclasses.replace(FP, tp_rank=1, tp_size=2)
    assert k.digest != key_from_engine_hash(other, "sha256_cbor", h).digest
    assert k != key_from_engine_hash(FP, "sha256_cbor", h[:-1] + b"\x00")


@pytest.mark.parametrize("b", [b"\x01" * 16, b"\x00" * 16, b"\xff" * 32, bytes(range(20))])
def test_int_and_bytes_engine_hashes_do_not_collide(b: bytes) -> None:
    i = int.from_bytes(b, "big")
    assert key_from_engine_hash(FP, "s", i, allow_64bit=True) != key_from_engine_hash(FP, "s", b)
    assert key_from_engine_hash(FP, "s", b) == key_from_engine_hash(FP, "s", bytearray(b))


@given(st.integers(0, 2**256), st.integers(0, 2**256))
def test_int_engine_hashes_are_injective(a: int, b: int) -> None:
    ka, kb = (key_from_engine_hash(FP, "s", x, allow_64bit=True) for x in (a, b))
    assert (ka == kb) == (a == b)


def test_a_signed_64_bit_hash_is_its_unsigned_form_and_nothing_wider_folds() -> None:
    def key(h: int) -> object:
        return key_from_engine_hash(FP, "s", h, allow_64bit=True)

    assert key(-1) == key(2**64 - 1)  # the same 64 bits, signed or not
    assert key(-1) != key(1)
    assert key(-(2**63)) == key(2**63)
    for too_wide in (-(2**63) - 1, -(2**70) + 5, -(2**64)):
        with pytest.raises(KeyFormatError):
            key(too_wide)


def test_64_bit_engine_hashes_need_an_explicit_yes() -> None:
    for weak in (12345, 2**64 - 1, -5, b"\x00" * 8):
        with pytest.raises(KeyFormatError, match="64-bit|too short"):
            key_from_engine_hash(FP, "s", weak)
        key_from_engine_hash(FP, "s", weak, allow_64bit=True)
    with pytest.raises(KeyFormatError):
        key_from_engine_hash(FP, "s", b"\x00" * 7, allow_64bit=True)
    key_from_engine_hash(FP, "s", 2**64)  # a wider hash that happens to be small is rare


@pytest.mark.parametrize("bad", [[1, 2], (3,), True, 1.5, None, {"a": 1}])
def test_an_engine_hash_is_bytes_or_int_only(bad: object) -> None:
    with pytest.raises(KeyFormatError):
        key_from_engine_hash(FP, "s", bad, allow_64bit=True)  # type: ignore[arg-type]


def test_one_value_as_a_blocks_extras_is_refused_not_split() -> None:
    tokens = list(range(BT))
    for single in ("ab", b"\x01\x02"):
        with pytest.raises(KeyFormatError):
            block_keys(FP, tokens, [single])  # type: ignore[list-item]
    assert block_keys(FP, tokens, [["ab"]]) != block_keys(FP, tokens, [["a", "b"]])


def test_the_kv_layout_is_required() -> None:
    with pytest.raises(TypeError):
        ModelFingerprint("m", "bf16", 16)  # type: ignore[call-arg]
    with pytest.raises(KeyFormatError):
        ModelFingerprint("m", "bf16", 16, "")
    assert ModelFingerprint("m", "bf16", 16, "NHD").digest() != ModelFingerprint("m", "bf16", 16, "HND").digest()


def test_engine_hash_keys_differ_from_token_keys_and_need_a_scheme() -> None:
    tk = block_keys(FP, list(range(BT)))[0]
    assert key_from_engine_hash(FP, "s", tk.digest) != tk
    with pytest.raises(KeyFormatError):
        key_from_engine_hash(FP, "", b"x")


def test_golden_engine_hash_keys() -> None:
    fp = ModelFingerprint("m", "bf16", 16, "default")
    assert key_from_engine_hash(fp, "sha256_cbor", b"\x00" * 32).text == (
        "v1:a6df3b7a06ee5525d789812f5554b4c8:b1ac48b73482572a35eafb282e537ad053f24e596989ec52a54a6244844834dd"
    )
    assert key_from_engine_hash(fp, "builtin", 12345, allow_64bit=True).text == (
        "v1:a6df3b7a06ee5525d789812f5554b4c8:868c69ce3b87e681f6491a7a29a3689a6f8c6543bda1d5783c694666aed9818a"
    )


def test_a_fingerprints_digest_is_computed_once_and_every_key_is_what_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine derives a key per block per rank: the fingerprint's digest (its canonical
    bytes hashed) is computed at the first key and kept, and the keys are byte for byte the
    ones of a digest computed afresh each time."""
    made: list[bytes] = []
    real = hashlib.blake2b

    def counting(*args: Any, **kw: Any) -> Any:
        made.append(kw.get("person", b""))
        return real(*args, **kw)

    fp = ModelFingerprint(model="meta-llama/Llama-3-8B", dtype="bfloat16", block_tokens=16, kv_layout="BLNHC",
                          tp_rank=3, tp_size=8, extra={"hash": "sha256", "vllm": "0.33"})
    hashes = [bytes([i]) * 32 for i in range(64)]
    monkeypatch.setattr(hashlib, "blake2b", counting)  # (the one kvpool_client.keys calls)
    got = [key_from_engine_hash(fp, "vllm-sha256", h) for h in hashes]
    got += block_keys(fp, list(range(4 * 16)))
    assert made.count(b"kvpool-fp-v1") == 1  # the fingerprint's digest, once for all 68 keys
    monkeypatch.undo()
    fresh = hashlib.blake2b(fp.canonical_bytes(), digest_size=FINGERPRINT_BYTES, person=b"kvpool-fp-v1").digest()

    def lp(b: bytes) -> bytes:
        return len(b).to_bytes(4, "little") + b

    assert fp.digest() == fresh
    assert [k.raw for k in got[:64]] == [  # (the construction key_from_engine_hash documents, from the fresh digest)
        fresh + hashlib.blake2b(lp(fresh) + lp(b"vllm-sha256") + lp(b"b" + h), digest_size=DIGEST_BYTES,
                                person=b"kvpool-ext-v1").digest() for h in hashes]
    again = dataclasses.replace(fp)  # (another fingerprint of the same fields: its own digest, the same bytes)
    assert block_keys(again, list(range(4 * 16))) == got[64:] and all(k.fingerprint == fresh for k in got[64:])
    copied = pickle.loads(pickle.dumps(fp))
    assert copied == fp and copied.digest() == fresh


def test_a_fingerprint_whose_extra_changed_after_its_digest_gets_the_new_digest() -> None:
    """``extra`` is a mapping its caller may still hold: a digest kept from before a change
    would key two models' blocks alike."""
    extra = {"quant": "awq"}
    fp = ModelFingerprint(model="m", dtype="bfloat16", block_tokens=16, kv_layout="BLNHC", extra=extra)
    before = fp.digest()
    extra["quant"] = "gptq"
    after = fp.digest()
    assert after != before
    assert after == ModelFingerprint(model="m", dtype="bfloat16", block_tokens=16, kv_layout="BLNHC",
                                     extra={"quant": "gptq"}).digest()

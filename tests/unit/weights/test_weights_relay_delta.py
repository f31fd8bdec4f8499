"""Delta versions on the cross-site relay (weights/relay_delta.py): a relay that holds the version
before is sent only what changed, rebuilds the whole version bit for bit, and gets the whole
version, told why, whenever a delta cannot be trusted or does not pay. Real sockets on loopback;
faults are set up before each fetch, so no outcome depends on timing.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from support.netproxy import Proxy, cut_after
from support.weights_relay import CHUNK, TOKEN

from streamrl_cli.errors import RecipeError
from streamrl_cli.generator.main import transfer_metrics
from streamrl_cli.generator.weights import RelayPath
from streamrl_cli.recipe.load import load
from streamrl_cli.recipe.schema import GeneratorConfig
from streamrl_cli.roles.spec import GeneratorSpec
from streamrl_cli.trainer.role.publish import WeightPublisher
from streamrl_cli.weights import relay_delta as rd
from streamrl_cli.weights import relay_wire as rw
from streamrl_cli.weights.plan import stream_layout
from streamrl_cli.weights.relay import Fetched, WeightServer, fetch_weights


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 128, generator=g),  # fp32, spans chunks
        "layer.0.w": torch.randn(256, 256, generator=g).to(torch.bfloat16),
        "layer.0.b": torch.randn(7, generator=g),
        "noise": noise(g),  # every bit may change every version: no encoding beats its bytes
        "steps": torch.tensor(41, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "head": torch.randn(64, 300, generator=g).t(),  # non-contiguous at the source
    }


def random_bits(g: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """Random bits as `dtype` (NaN payloads included): what no delta can shrink."""
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def noise(g: torch.Generator) -> torch.Tensor:
    return random_bits(g, torch.float32, 4096)


def step(w: dict[str, torch.Tensor], g: torch.Generator, share: float = 0.01) -> dict[str, torch.Tensor]:
    """The next version: a small update to a random `share` of the float values (most of which a bf16
    copy does not even see), new noise, one more step."""
    out = {k: v.clone() for k, v in w.items()}
    for name in ("embed", "layer.0.w", "layer.0.b", "head"):
        t = out[name]
        picked = torch.rand(t.shape, generator=g) < share
        update = (1e-2 * torch.randn(t.shape, generator=g)).to(t.dtype)
        t.copy_(torch.where(picked, t + update, t))
    out["noise"] = noise(g)
    out["steps"] += 1
    return out


def two_versions(server, seed: int):  # type: ignore[no-untyped-def]
    """Version 1 published and fetched whole (the relay's base), then version 2 published (a delta
    from 1 waits): (version 1, the fetched base, version 2)."""
    g = torch.Generator().manual_seed(seed)
    first = model(seed)
    server.publish(1, first)
    held = fetch_weights(server.address, TOKEN)
    second = step(first, g)
    server.publish(2, second)
    return first, held, second


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: Fetched, want: dict[str, torch.Tensor]) -> None:
    assert list(got.tensors) == list(want)
    for k, w in want.items():
        g = got.tensors[k]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), k
        assert torch.equal(raw(g), raw(w)), k


def kinds(got: Fetched) -> dict[str, str]:
    return {name: d.kind for name, d in zip(got.tensors, got.delta, strict=True)}


@pytest.fixture
def server():
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    yield srv
    srv.close()


def test_twenty_versions_cross_as_deltas_and_arrive_bit_exact(server):
    g = torch.Generator().manual_seed(1)
    w = model()
    server.publish(1, w)
    held = fetch_weights(server.address, TOKEN, streams=2)
    assert_same(held, w)
    assert (held.stats["mode"], held.stats["reason"]) == ("full", "no_base")  # a newcomer
    spare, sizes = None, []
    for version in range(2, 21):
        w = step(w, g)
        server.publish(version, w)
        got = fetch_weights(server.address, TOKEN, base=held, out=spare, streams=2)
        assert_same(got, w)
        assert got.version == version and got.stats["mode"] == "delta" and got.stats["base"] == version - 1
        k = kinds(got)
        assert k["noise"] == "raw" and k["empty"] == k["mask"] == "same"  # changed wholly, not at all
        assert k["embed"] == "sparse16" and k["layer.0.w"] in ("sparse16", "same")
        assert got.stats["bytes_received"] < got.stats["full_bytes"] / 5, got.stats
        sizes.append(got.stats["bytes_received"])
        spare, held = held.buffer, got  # what a relay does: the version before's buffer is reused
    assert held.buffer.data_ptr() != spare.data_ptr()
    full = held.stats["full_bytes"]
    print(f"\nwhole version {full} B; deltas per version (B): {sizes}")  # the report's numbers (-s)


def test_only_the_dtype_the_generators_load_is_compared_not_fp32_masters(server):
    """fp32 master weights change everywhere at every step; the bf16 copy that is published (and
    loaded) changes only where an update crosses its resolution, and only that crosses."""
    g = torch.Generator().manual_seed(2)
    master = torch.randn(512, 256, generator=g)
    server.publish(1, {"w": master.to(torch.bfloat16)})
    held = fetch_weights(server.address, TOKEN)
    master += 1e-4 * torch.randn(master.shape, generator=g)  # every fp32 value moves
    server.publish(2, {"w": master.to(torch.bfloat16)})
    got = fetch_weights(server.address, TOKEN, base=held)
    assert torch.equal(got.tensors["w"], master.to(torch.bfloat16))
    changed = got.delta[0].changed
    assert got.stats["mode"] == "delta" and 0 < changed < master.numel() // 10, changed
    assert got.stats["bytes_received"] < got.stats["full_bytes"] / 4, got.stats


def test_the_base_is_never_received_into(server):
    w1, held, w2 = two_versions(server, 14)
    got = fetch_weights(server.address, TOKEN, base=held, out=held.buffer)  # as a careless caller might
    assert_same(got, w2)
    assert_same(held, w1)  # still version 1, whole
    assert got.buffer.data_ptr() != held.buffer.data_ptr()


def test_a_version_where_everything_changed_crosses_whole(server):
    """Per tensor, one that changed beyond compression is sent raw (``noise`` above); when that is
    every tensor, the delta is no smaller than the version and the version crosses whole."""
    g = torch.Generator().manual_seed(3)

    def version() -> dict[str, torch.Tensor]:
        return {
            "a": random_bits(g, torch.float32, 300, 128),
            "b": random_bits(g, torch.bfloat16, 256, 256),
            "c": random_bits(g, torch.uint8, 1000),
        }

    server.publish(1, version())
    held = fetch_weights(server.address, TOKEN)
    w = version()
    server.publish(2, w)
    got = fetch_weights(server.address, TOKEN, base=held)
    assert_same(got, w)
    assert (got.stats["mode"], got.stats["reason"]) == ("full", "not_smaller")
    assert got.stats["bytes_received"] == got.stats["full_bytes"] and server.stats["delta_bytes"] == 0


def _corrupt_delta(server: WeightServer, base: int) -> int:
    """Flip one byte in the middle of the delta the server holds from `base`, before any chunk of it
    was asked for (chunk digests are computed on first request, so they match the flipped bytes:
    only the per-tensor digests can tell). Returns the delta's size."""
    stream = server._current.deltas[base]
    data = bytearray(stream.data)
    data[len(data) // 2] ^= 0x10
    stream.data, stream.owner = memoryview(bytes(data)), data
    return len(data)


def test_a_delta_whose_bytes_were_flipped_fails_its_checksum_and_the_version_comes_whole(server):
    _, held, w = two_versions(server, 5)
    size = _corrupt_delta(server, 1)
    got = fetch_weights(server.address, TOKEN, base=held)
    assert_same(got, w)
    assert (got.stats["mode"], got.stats["reason"]) == ("full", "checksum")
    assert got.stats["bytes_received"] == size + got.stats["full_bytes"]  # both tries crossed
    assert server.stats["delta_bytes"] == size and got.delta == []


def test_a_base_that_is_no_longer_bit_exact_fails_the_checksum_and_is_replaced(server):
    g = torch.Generator().manual_seed(6)
    w = model(6)
    server.publish(1, w)
    held = fetch_weights(server.address, TOKEN)
    held.tensors["layer.0.b"][3] += 1  # something wrote into the relay's copy
    w = step(w, g)
    server.publish(2, w)
    got = fetch_weights(server.address, TOKEN, base=held)
    assert_same(got, w)
    assert (got.stats["mode"], got.stats["reason"]) == ("full", "checksum")
    w = step(w, g)
    server.publish(3, w)
    again = fetch_weights(server.address, TOKEN, base=got)  # the whole version is a sound base
    assert_same(again, w)
    assert again.stats["mode"] == "delta"


def test_a_base_the_server_no_longer_has_a_delta_from_gets_the_whole_version(server):
    g = torch.Generator().manual_seed(7)
    w = model(7)
    server.publish(1, w)
    held = fetch_weights(server.address, TOKEN)
    for version in (2, 3):  # the server keeps the delta from 2 only
        w = step(w, g)
        server.publish(version, w)
    got = fetch_weights(server.address, TOKEN, base=held)
    assert_same(got, w)
    assert (got.stats["mode"], got.stats["reason"]) == ("full", "base_gone")
    # A relay that holds the current version already is sent nothing but the manifest.
    same = fetch_weights(server.address, TOKEN, base=got)
    assert_same(same, w)
    assert same.stats["mode"] == "delta" and same.stats["bytes_received"] == 0
    assert set(kinds(same).values()) == {"same"}


def test_a_server_restarted_between_base_and_delta_sends_the_whole_version():
    g = torch.Generator().manual_seed(8)
    w = model(8)
    first = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK)
    try:
        first.publish(1, w)
        held = fetch_weights(first.address, TOKEN)
    finally:
        first.close()
    restarted = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK)
    try:
        restarted.publish(1, w)  # the same version number and bytes, from another process: not trusted
        w = step(w, g)
        restarted.publish(2, w)
        got = fetch_weights(restarted.address, TOKEN, base=held)
        assert_same(got, w)
        assert (got.stats["mode"], got.stats["reason"]) == ("full", "new_server")
        w = step(w, g)
        restarted.publish(3, w)
        assert fetch_weights(restarted.address, TOKEN, base=got).stats["mode"] == "delta"
    finally:
        restarted.close()


def test_deltas_turned_off_on_either_side_send_every_version_whole():
    g = torch.Generator().manual_seed(9)
    w = model(9)
    off = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, delta=False)
    on = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK)
    try:
        for srv in (off, on):
            srv.publish(1, w)
        held_off, held_on = fetch_weights(off.address, TOKEN), fetch_weights(on.address, TOKEN)
        w = step(w, g)
        for srv in (off, on):
            srv.publish(2, w)
        assert off._current.deltas == {}  # nothing computed, nothing held but the version
        got = fetch_weights(off.address, TOKEN, base=held_off)  # the relay asks; the server says no
        assert_same(got, w)
        assert (got.stats["mode"], got.stats["reason"]) == ("full", "off")
        got = fetch_weights(on.address, TOKEN, base=held_on, delta=False)  # the relay does not ask
        assert_same(got, w)
        assert (got.stats["mode"], got.stats["reason"]) == ("full", "off") and on.stats["delta_bytes"] == 0
    finally:
        off.close()
        on.close()


def test_a_delta_over_several_chunks_survives_a_broken_stream():
    g = torch.Generator().manual_seed(10)
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=1024, checksum="crc32")
    try:
        w = model(10)
        srv.publish(1, w)
        held = fetch_weights(srv.address, TOKEN)
        w = step(w, g, share=0.05)
        srv.publish(2, w)
        size = srv._current.deltas[1].manifest.total
        assert size > 4 * 1024  # several chunks
        # One stream (so which one breaks is not a race), cut after 3000 bytes: mid-delta.
        proxy = Proxy(srv.address, tamper=cut_after(0, "down", 3000))
        try:
            got = fetch_weights(proxy.address, TOKEN, base=held, streams=1, batch=1, depth=1)
        finally:
            proxy.close()
        assert_same(got, w)
        assert got.stats["mode"] == "delta" and got.stats["reconnects"] == 1
    finally:
        srv.close()


def test_the_transfer_metrics_say_what_crossed(server):
    g = torch.Generator().manual_seed(11)
    w = model(11)
    server.publish(1, w)
    held = fetch_weights(server.address, TOKEN)
    m = transfer_metrics(1, 0.5, {"bytes": 10, "relay": held.stats})
    assert m["weights/wan_mode"] == "full" and m["weights/wan_reason"] == "no_base"
    assert m["weights/wan_bytes"] == m["weights/wan_full_bytes"] == held.stats["full_bytes"]
    assert m["weights/wan_ratio"] == 1.0
    w = step(w, g)
    server.publish(2, w)
    got = fetch_weights(server.address, TOKEN, base=held)
    m = transfer_metrics(2, 0.5, {"bytes": 10, "relay": got.stats})
    assert m["weights/wan_mode"] == "delta" and m["weights/wan_reason"] == ""
    assert m["weights/wan_bytes"] == got.stats["bytes_received"] < m["weights/wan_full_bytes"]
    assert m["weights/wan_ratio"] == round(m["weights/wan_full_bytes"] / m["weights/wan_bytes"], 2) > 5
    assert m["weights/wan_s"] == round(got.stats["seconds"], 3)
    assert set(rw.FULL_REASONS) >= {
        "no_base",
        "off",
        "new_server",
        "base_gone",
        "not_smaller",
        "checksum",
    }


# ---- the encoding alone (relay_delta, no sockets) ----


def _stream(tensors: dict[str, torch.Tensor]) -> tuple[np.ndarray, list]:
    entries = [
        (n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
        for n, t in tensors.items()
    ]
    specs, total = stream_layout(entries)
    buf = np.zeros(total, dtype=np.uint8)
    for s, t in zip(specs, tensors.values(), strict=True):
        buf[s.offset : s.offset + s.nbytes] = raw(t).numpy()
    return buf, specs


def test_every_kind_round_trips_bit_exact_nan_payloads_and_signed_zeros_included():
    def bits(*values: int) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype=np.uint32).view(np.float32))

    old = {
        "nan": bits(0x7FC00001, 0x7FC00002, 0x80000000, 0),
        "same": torch.arange(10.0),
        "renamed_away": torch.ones(3),
        "grown": torch.ones(4),
    }
    new = {
        "nan": bits(0x7FC00003, 0x7FC00002, 0, 0x80000000),  # NaN payloads, -0.0 and +0.0 swapped
        "same": torch.arange(10.0),
        "fresh": torch.ones(3),  # no base of that name
        "grown": torch.ones(5),  # its base has another shape
    }
    a, a_specs = _stream(old)
    b, b_specs = _stream(new)
    digests = rd.digests(b, b_specs)
    entries, payload = rd.encode(b, b_specs, a, a_specs, digests)
    assert [e.kind for e in entries][1:] == ["same", "raw", "raw"]
    out = np.full(rd.stream_size(b_specs), 0xAB, dtype=np.uint8)
    assert rd.apply(np.frombuffer(payload, dtype=np.uint8), entries, b_specs, a, a_specs, out) is None
    assert bytes(out) == bytes(b)  # padding included
    # Against the wrong base, the digest says so, naming the tensor.
    wrong = a.copy()
    wrong[a_specs[1].offset + 5] ^= 1
    why = rd.apply(np.frombuffer(payload, dtype=np.uint8), entries, b_specs, wrong, a_specs, out)
    assert why == "tensor 'same' (same): checksum mismatch"


@pytest.mark.parametrize("share", [0.001, 0.9])
def test_scattered_changes_go_sparse_and_dense_ones_go_xor_planes(share):
    g = torch.Generator().manual_seed(12)
    old = {"w": torch.randn(100_000, generator=g).to(torch.bfloat16)}
    picked = torch.rand(100_000, generator=g) < share
    new = {"w": torch.where(picked, old["w"] * 1.01 + 0.01, old["w"])}
    a, specs = _stream(old)
    b, _ = _stream(new)
    entries, payload = rd.encode(b, specs, a, specs, rd.digests(b, specs))
    assert entries[0].changed == int(
        (raw(new["w"]).view(torch.int16) != raw(old["w"]).view(torch.int16)).sum()
    )
    assert entries[0].kind == ("sparse16" if share < 0.01 else "xor_planes")
    assert len(payload) < math.ceil(b.nbytes * (0.05 if share < 0.01 else 0.9))
    out = np.empty_like(b)
    assert rd.apply(np.frombuffer(payload, dtype=np.uint8), entries, specs, a, specs, out) is None
    assert bytes(out) == bytes(b)


def _apply(payload: bytes, entries, specs, base, base_specs) -> tuple[str | None, np.ndarray]:
    out = np.full(rd.stream_size(specs), 0xAB, dtype=np.uint8)
    return rd.apply(np.frombuffer(payload, dtype=np.uint8), entries, specs, base, base_specs, out), out


def test_twenty_versions_of_every_dtype_and_density_rebuild_bit_exact_whatever_the_threads(monkeypatch):
    """Pure encode/apply over 20 versions: per version a different share of each tensor changes (none,
    a few, a third, most, all), in 1-, 2-, 4- and 8-byte dtypes, plus a tensor that never changes,
    one whose bits all change, one whose changes lie further apart than 16 bits can say and one
    that changes only in its second part. The delta is the same bytes on one thread as on several
    and a block at a time in small blocks as in large ones, and every kind is used."""
    g = torch.Generator().manual_seed(15)
    shares = [0.0, 0.002, 0.05, 0.3, 0.7, 1.0]
    w = {
        "bf16": torch.randn(40_000, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(123, 77, generator=g),
        "u8": torch.randint(0, 256, (9_999,), dtype=torch.uint8, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (3_000,), generator=g),
        "frozen": torch.randn(1_000, generator=g).to(torch.bfloat16),
        "noise": noise(g),
        "far": torch.zeros(70_000, dtype=torch.uint8),  # changes at both ends only: a gap over 2**16
        "tail": torch.randn(30_000, generator=g).to(torch.bfloat16),  # its last 60% change wholly
    }
    seen = set()
    for version in range(20):
        new = {k: v.clone() for k, v in w.items()}
        for i, name in enumerate(("bf16", "fp32", "u8", "i64")):
            t = new[name].view(-1)
            picked = torch.rand(t.shape, generator=g) < shares[(version + i) % len(shares)]
            flipped = random_bits(g, t.dtype, t.numel())
            t.copy_(torch.where(picked, flipped, t))
        new["noise"] = noise(g)
        new["far"][0] += 1
        new["far"][-1] += 1
        new["tail"][12_000:] = random_bits(g, torch.bfloat16, 18_000)
        a, a_specs = _stream(w)
        b, specs = _stream(new)
        digests = rd.digests(b, specs)
        entries, payload = rd.encode(b, specs, a, a_specs, digests)
        monkeypatch.setattr(rd, "THREADS", 1)
        monkeypatch.setattr(rd, "BLOCK", 4096)  # many blocks per tensor: dense found mid-tensor
        assert rd.encode(b, specs, a, a_specs, digests) == (entries, payload)
        monkeypatch.undo()
        why, out = _apply(payload, entries, specs, a, a_specs)
        assert why is None and bytes(out) == bytes(b), (version, why)
        k = {s.name: e.kind for s, e in zip(specs, entries, strict=True)}
        assert k["frozen"] == "same" and k["noise"] == "raw" and k["far"] == "sparse32", k
        assert k["tail"] == "xor_planes", k
        for s, e in zip(specs, entries, strict=True):
            unit = np.dtype(f"u{new[s.name].element_size()}")
            diff = np.count_nonzero(raw(w[s.name]).numpy().view(unit) != raw(new[s.name]).numpy().view(unit))
            assert e.changed == diff or e.kind == "raw", (s.name, e)
        seen |= set(k.values())
        w = new
    assert seen == set(rd.KINDS)


def test_a_tensor_the_base_lacks_or_a_stream_too_short_is_refused_not_guessed():
    g = torch.Generator().manual_seed(16)
    old = {"w": torch.randn(5_000, generator=g).to(torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][::100] += 1
    a, specs = _stream(old)
    b, _ = _stream(new)
    entries, payload = rd.encode(b, specs, a, specs, rd.digests(b, specs))
    assert entries[0].kind == "sparse16"
    other, other_specs = _stream({"v": old["w"]})  # a base without a tensor of that name
    assert _apply(payload, entries, specs, other, other_specs)[0] == (
        "tensor 'w' (sparse16): the base holds no such tensor"
    )
    why, _ = _apply(payload[:-1], entries, specs, a, specs)
    assert why is not None and why.startswith("tensor 'w' (sparse16): entry out of the delta stream")


def test_an_earlier_streamrls_sparse_and_xor_deltas_are_still_rebuilt():
    """Before byte planes (same protocol): ``sparse`` held int32 gaps and the values as they are,
    ``xor`` the XOR as it is. A relay of this version rebuilds both."""
    import zstandard

    g = torch.Generator().manual_seed(17)
    old = {"s": torch.randn(20_000, generator=g).to(torch.bfloat16), "x": torch.randn(999, generator=g)}
    new = {k: v.clone() for k, v in old.items()}
    new["s"][::37] *= 1.5
    new["x"] += 1.0
    a, specs = _stream(old)
    b, _ = _stream(new)
    xs = (raw(new["s"]).numpy().view(np.uint16)) ^ (raw(old["s"]).numpy().view(np.uint16))
    pos = np.flatnonzero(xs)
    sparse = zstandard.compress(np.diff(pos, prepend=0).astype(np.int32).tobytes() + xs[pos].tobytes())
    xor = zstandard.compress((raw(new["x"]).numpy() ^ raw(old["x"]).numpy()).tobytes())
    digests = rd.digests(b, specs)
    entries = [
        rd.TensorDelta("sparse", 0, len(sparse), len(pos), digests[0]),
        rd.TensorDelta("xor", len(sparse), len(xor), 999, digests[1]),
    ]
    why, out = _apply(sparse + xor, entries, specs, a, specs)
    assert why is None and bytes(out) == bytes(b)


def test_a_delta_of_a_kind_this_relay_does_not_know_comes_whole_and_is_logged(server, caplog):
    """What a relay of an older StreamRL does with a newer trainer's encoding (the kinds name their
    format): it refuses the delta, says which kind, and fetches the whole version."""
    _, held, w = two_versions(server, 18)
    stream = server._current.deltas[1]
    entries = [msgspec.structs.replace(e, kind="sparse7") if e.kind == "sparse16" else e
               for e in stream.manifest.delta]  # fmt: skip
    stream.manifest = msgspec.structs.replace(stream.manifest, delta=entries)
    with caplog.at_level("WARNING", logger="streamrl.weights.relay"):
        got = fetch_weights(server.address, TOKEN, base=held)
    assert_same(got, w)
    assert (got.stats["mode"], got.stats["reason"]) == ("full", "checksum")
    assert "unknown kind 'sparse7'" in caplog.text


def test_a_relay_restarted_between_a_base_and_its_delta_gets_the_whole_version_and_says_so(server):
    """The relay held version 1; the trainer published 2 (a delta from 1 waits for it); the relay
    process died and a new one started, holding nothing: version 2 comes whole, recorded as
    ``no_base`` in its metrics, and version 3 as a delta from 2 again."""
    g = torch.Generator().manual_seed(19)
    w = model(19)
    server.publish(1, w)
    assert _relay("delta")._fetch(server.address, 1).stats["mode"] == "full"  # then it dies
    w = step(w, g)
    server.publish(2, w)
    assert 1 in server._current.deltas
    relay = _relay("delta")  # the new relay process
    got = relay._fetch(server.address, 2)
    assert_same(got, w)
    m = transfer_metrics(2, 0.5, {"bytes": 10, "relay": got.stats})
    assert (m["weights/wan_mode"], m["weights/wan_reason"]) == ("full", "no_base")
    assert m["weights/wan_bytes"] == m["weights/wan_full_bytes"]
    w = step(w, g)
    server.publish(3, w)
    got = relay._fetch(server.address, 3)
    assert_same(got, w)
    assert (got.stats["mode"], got.stats["base"]) == ("delta", 2)


# ---- who switches it: roles.generator.relay_sync, read by the relay and by the trainer ----


def _relay(sync: str) -> RelayPath:
    spec = GeneratorSpec(
        run_name="delta", run_dir="/nowhere", role="generator", cluster="far", site="far", world=1,
        expected={"trainer": 1, "generator": 1}, program="streamrl_cli.generator.main:main",
        weight_transport="relay", rendezvous_file="/nowhere/rendezvous.json", secret_file="/nowhere/secret",
        settings=GeneratorConfig(cluster="far", relay_sync=sync),
    )  # fmt: skip
    return RelayPath(spec, 0, engine=None, rdv=None, token=TOKEN, source=object())  # only _fetch is used


def test_the_relay_keeps_the_last_version_as_the_next_base_unless_relay_sync_is_full(server):
    g = torch.Generator().manual_seed(13)
    w = model(13)
    relay, whole = _relay("delta"), _relay("full")
    server.publish(1, w)
    first = relay._fetch(server.address, 1)
    assert first.stats["reason"] == "no_base" and whole._fetch(server.address, 1).stats["reason"] == "off"
    buffers = {1: first.buffer.data_ptr()}
    for version in (2, 3, 4):
        w = step(w, g)
        server.publish(version, w)
        got = relay._fetch(server.address, version)
        assert_same(got, w)
        assert got.stats["mode"] == "delta" and relay._held is got
        buffers[version] = got.buffer.data_ptr()
        off = whole._fetch(server.address, version)
        assert (off.stats["mode"], off.stats["reason"]) == ("full", "off") and whole._held is None
    # Two buffers in turn: each version is received into the one two versions back, never the base's.
    assert buffers[3] == buffers[1] and buffers[4] == buffers[2] != buffers[1]


def test_relay_sync_reaches_the_trainers_weight_server_and_is_validated():
    for deltas in (True, False):
        publisher = WeightPublisher(
            None, TOKEN, transport="relay", generator_workers=1, backend="gloo", relay_deltas=deltas
        )
        try:
            assert publisher.server.delta is deltas
        finally:
            publisher.close()
    assert load("local", ["roles.generator.relay_sync=full"]).recipe.roles.generator.relay_sync == "full"
    with pytest.raises(RecipeError, match="roles.generator.relay_sync: 'partial' is not one of delta, full"):
        load("local", ["roles.generator.relay_sync=partial"])

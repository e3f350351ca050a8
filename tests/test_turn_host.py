"""The decode loop's host work per sync and per tool turn (issue 47) against the code it replaced, written here
as naive references: columns.StopRows against the whole-row scan it replaced (StopScanner.cut on every row at
every sync) and against the plain whole-text test; turns.TurnRows.report's one gather for a sync's kept blocks
and turns.prefill_resumed's one gather of the pasts against a gather per row and a pad per row. Equal bit for
bit: the same tokens and log-probs come out of the decode."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_grpo.models import decoder
from mlx_grpo.models.forward import bucket
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.rollout.columns import StopRows
from mlx_grpo.rollout.sampler import StopScanner, closing_tokens, stop_cut
from mlx_grpo.rollout.turns import Kept, TurnRows, prefill_resumed

PIECES = ["a", "b", "c", "<", "/", "calc>", "</calc", ">", " ", "é", "<|im_end|>", "x", "12", "\n"]
STOP_SETS = [("</calc>",), ("</calc>", "<|im_end|>x", "ab"), ("b",), ("\n\n", "é>"), ()]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tests' tiny llama and its byte-level tokenizer (ChatML specials)."""
    return load_model(str(tiny_model_dir), "float32")


# ----------------------------------------------------------------------------- naive references

def naive_whole_text(tok, ids: np.ndarray, rows: np.ndarray, stops) -> np.ndarray:
    """Each slot: a filler (-1), or its row's whole text holds a stop string."""
    return np.array([r < 0 or any(s in tok.decode([t for t in ids[r].tolist() if t >= 0]) for s in stops)
                     for r in rows])


def scanned_before(ids: np.ndarray, rows, scanner: StopScanner, on_stop=None) -> np.ndarray:
    """engine._stopped before issue 47: every slot's whole row as a list, StopScanner.cut on it."""
    out = []
    for r in rows:
        row = [] if r < 0 else [t for t in ids[r].tolist() if t >= 0]
        cut = None if r < 0 else scanner.cut(int(r), row)
        if cut is not None and on_stop is not None:
            on_stop(int(r), row[:cut])
        out.append(r < 0 or cut is not None)
    return np.array(out)


def per_row_blocks(keys: mx.array, values: mx.array, spans, start: np.ndarray) -> dict:
    """TurnRows.report before issue 47: one gather per kept row, [layers, Hkv, kept, Dh] each."""
    out = {}
    for slot, r, kept in spans:
        at = mx.arange(int(start[slot]), int(start[slot]) + kept)
        out[r] = (mx.take(keys[:, slot], at, axis=2), mx.take(values[:, slot], at, axis=2))
    return out


def padded_pasts(admitted, width: int) -> tuple[mx.array, mx.array]:
    """prefill_resumed's pasts before issue 47: each row's block padded into place, then stacked."""
    place = [[(0, 0), (0, 0), (width - len(c), len(c) - k.shape[2]), (0, 0)] for c, (k, _) in admitted]
    return (mx.stack([mx.pad(k, p) for p, (_, (k, _)) in zip(place, admitted)], axis=1),
            mx.stack([mx.pad(v, p) for p, (_, (_, v)) in zip(place, admitted)], axis=1))


# ----------------------------------------------------------------------------- stop strings

@pytest.mark.parametrize("seed", range(8))
def test_stop_rows_equal_the_whole_row_scan_and_the_whole_text(tiny, seed):
    """Rows growing by random pieces between syncs, random stop sets, fillers and rows leaving the batch: at every
    sync StopRows says what the whole-row scan said (and on_stop hears the same rows and cuts, each row once), which is what
    the whole text says."""
    _, tok = tiny
    rng = np.random.default_rng(seed)
    stops = STOP_SETS[seed % len(STOP_SETS)]
    n_rows, T = 12, 160
    ids, filled = np.full((n_rows, T), -1, np.int64), np.zeros(n_rows, np.int64)
    fast, scanner = StopRows(tok, stops), StopScanner(tok, stops)
    table = closing_tokens(tok, stops)
    assert (table is None) == (not stops or stops == ("\n\n", "é>"))  # a stop ending in white space: no table
    tabled = StopRows(tok, stops, table)
    heard_fast, heard_before, heard_tabled, seen = [], [], [], 0
    for _ in range(14):
        for r in range(n_rows):
            for _ in range(int(rng.integers(0, 4))):  # a row may write nothing between two syncs
                piece = tok.encode(PIECES[int(rng.integers(len(PIECES)))], add_special_tokens=False)[:T - filled[r]]
                ids[r, filled[r]:filled[r] + len(piece)] = piece
                filled[r] += len(piece)
        rows = rng.permutation(np.concatenate([np.arange(n_rows), [-1, -1]]))[:int(rng.integers(6, n_rows + 2))]
        got = fast.stopped(ids, filled, rows, lambda r, row: heard_fast.append((r, row)))
        want = scanned_before(ids, rows, scanner, lambda r, row: heard_before.append((r, row)))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(tabled.stopped(ids, filled, rows, lambda r, row: heard_tabled.append((r, row))),
                                      want)
        np.testing.assert_array_equal(got, naive_whole_text(tok, ids, rows, stops))
        seen += int((got & (rows >= 0)).sum())
    first_heard = [(r, row) for i, (r, row) in enumerate(heard_before) if r not in {q for q, _ in heard_before[:i]}]
    assert heard_fast == first_heard == heard_tabled  # each stopped row once, at the first sync that saw its stop
    assert all(stop_cut(tok, row, stops) == len(row) for _, row in heard_fast)  # each cut right after its stop
    if stops and stops != ("\n\n", "é>"):
        assert seen > 0  # rows stopped, and were asked about again


def test_closing_tokens_are_the_ids_writing_a_stops_last_character(tiny):
    """sampler.closing_tokens: True exactly for the ids whose own text holds a stop string's last character, for
    ids past the vocabulary, False for -1 (unwritten); None for stop strings ending in white space or a non-ASCII
    character, an empty one, none at all, or a tokenizer with a decode of its own."""
    from transformers import PreTrainedTokenizerFast

    tok = tiny[1]
    V = len(tok.get_vocab())
    table = closing_tokens(tok, ("</calc>", "ab"))
    assert table.shape == (V + 2,) and table[V] and not table[-1]
    want = [(">" in tok.decode([i])) or ("b" in tok.decode([i])) for i in range(V)]
    assert table[:V].tolist() == want and 0 < sum(want) < V
    assert table[tok.encode(">", add_special_tokens=False)[-1]]
    for stops in [(), ("</calc>", "\n"), ("x é",), ("</calc>", "")]:
        assert closing_tokens(tok, stops) is None, stops

    class Own(PreTrainedTokenizerFast):
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()
    assert closing_tokens(Own(tokenizer_object=tok._tokenizer.backend_tokenizer), ("</calc>",)) is None
    assert closing_tokens(byte_fallback_tokenizer(), ("</calc>",)) is None  # not byte-level: no table
    from tokenizers import Tokenizer, decoders
    backend = Tokenizer.from_str(tok._tokenizer.backend_tokenizer.to_str())
    backend.decoder = decoders.Sequence([decoders.ByteLevel()])  # LFM2's tokenizer.json writes it so
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert (closing_tokens(wrapped, ("</calc>", "ab")) == table).all()


def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2, Mistral, Gemma): BPE with byte fallback, whose decoder writes a
    '>' byte followed by a lead byte as two replacement characters until the bytes after it arrive."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "</", "calc", ">", "x", "</calc"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    byte = lambda b: 3 + b  # noqa: E731
    # the reason: '>' then a lead byte shows no '>' until the continuation bytes come (a later token 'writes' it)
    ids = [vocab["x"], vocab["</calc"], byte(0x3E), byte(0xE2)]
    assert ">" not in tok.decode(ids) and "</calc>" in tok.decode(ids + [byte(0x82), byte(0xAC)])
    return tok


def test_a_stop_is_completed_by_a_token_of_the_table(tiny):
    """The property closing_tokens rests on, checked on sequences of any ids (partial UTF-8 bytes, specials, ids
    no encode writes): wherever a prefix's text first holds a stop string, its last token is in the table; and
    stop_cut with the table cuts there."""
    tok = tiny[1]
    V = len(tok.get_vocab())
    rng = np.random.default_rng(3)
    stop_ids = tok.encode("</calc>", add_special_tokens=False)
    for stops in [("</calc>",), ("</calc>", "é>", "<|im_end|>x")]:
        table, found = closing_tokens(tok, stops), 0
        for _ in range(400):
            ids = [int(i) for i in rng.integers(0, V, size=int(rng.integers(1, 24)))]
            at = int(rng.integers(0, len(ids) + 1))
            ids[at:at] = stop_ids if rng.random() < 0.5 else []
            cut = stop_cut(tok, ids, stops)
            if cut is not None:
                found += 1
                assert table[ids[cut - 1]], ids
            assert stop_cut(tok, ids, stops, table) == cut, ids
        assert found > 100


@pytest.mark.parametrize("seed", range(4))
def test_stop_cut_with_the_table_is_the_search(tiny, seed):
    """stop_cut and completion_end with closing_tokens' table cut where the binary search over prefixes cuts,
    on rows of random pieces (stops split across tokens, several per row, none, specials, end tokens)."""
    from mlx_grpo.rollout.sampler import completion_end

    _, tok = tiny
    rng = np.random.default_rng(seed)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    for stops in [s for s in STOP_SETS if closing_tokens(tok, s) is not None] + [("<|im_end|>",)]:
        table = closing_tokens(tok, stops)
        for _ in range(60):
            text = "".join(PIECES[int(i)] for i in rng.integers(len(PIECES), size=int(rng.integers(0, 30))))
            ids = tok.encode(text, add_special_tokens=False)
            assert stop_cut(tok, ids, stops, table) == stop_cut(tok, ids, stops), (stops, text)
            assert completion_end(tok, ids, eos, stops, table) == completion_end(tok, ids, eos, stops), (stops, text)


def test_stop_rows_with_the_table_decode_only_rows_that_wrote_a_closing_token(tiny):
    """With closing_tokens' table, a row that never writes ">" is never decoded, however long it grows; the row
    that closes its call is decoded once it does, and found."""
    tok = _Counting(tiny[1])
    rows_ = StopRows(tok, ("</calc>",), closing_tokens(tiny[1], ("</calc>",)))
    ids, filled = np.full((2, 400), -1, np.int64), np.zeros(2, np.int64)
    x = tok.encode("x", add_special_tokens=False)[0]
    end = tok.encode("</calc>", add_special_tokens=False)
    for sync in range(40):
        ids[0, filled[0]:filled[0] + 8] = x
        filled[0] += 8
        if sync == 3:
            ids[1, :len(end)] = end
            filled[1] = len(end)
        got = rows_.stopped(ids, filled, np.array([0, 1]))
        assert got.tolist() == [False, sync >= 3]
    assert tok.decoded and all(n <= len(end) for n in tok.decoded)  # row 1 alone, never row 0


def test_stop_rows_with_the_table_scan_a_row_with_a_gap_as_before(tiny):
    """A row with a column never written inside its filled ones (which Written does not make today) is scanned as
    without the table, at every sync from the one that first shows the gap: the same answers, the same cut."""
    _, tok = tiny
    stops = ("</calc>",)
    plain, tabled = StopRows(tok, stops), StopRows(tok, stops, closing_tokens(tok, stops))
    ids, filled = np.full((2, 200), -1, np.int64), np.zeros(2, np.int64)
    x = tok.encode("x", add_special_tokens=False)[0]
    # the stop string's last token alone at sync 8 (a row with a gap decoded after its table clearing would lose it)
    opening, gt = tok.encode("</calc", add_special_tokens=False), tok.encode(">", add_special_tokens=False)
    heard = {"plain": [], "tabled": []}
    for sync in range(12):
        for r in range(2):
            piece = {(0, 2): [x, -1, x, x], (0, 7): opening, (0, 8): gt}.get((r, sync), [x] * 4)  # (0, 2): the gap
            ids[r, filled[r]:filled[r] + len(piece)] = piece
            filled[r] += len(piece)
        got = {name: rows_.stopped(ids, filled, np.array([0, 1]), lambda r, row, k=name: heard[k].append((r, row)))
               for name, rows_ in (("plain", plain), ("tabled", tabled))}
        np.testing.assert_array_equal(got["plain"], got["tabled"])
        assert got["tabled"].tolist() == [sync >= 8, False]
    assert heard["plain"] == heard["tabled"] and len(heard["tabled"]) == 1


def test_stop_rows_with_the_table_decode_a_cleared_row_from_where_it_was_cleared(tiny):
    """A row that writes a closing token without a stop is decoded at that sync, not at the syncs after that add
    none, and when it writes one again, only its new tail is decoded (the table's clearing moved its clean mark)."""
    tok = _Counting(tiny[1])
    rows_ = StopRows(tok, ("</calc>",), closing_tokens(tiny[1], ("</calc>",)))
    ids, filled = np.full((1, 600), -1, np.int64), np.zeros(1, np.int64)
    x, gt = (tok.encode(c, add_special_tokens=False)[0] for c in ("x", ">"))
    decoded_at = []
    for sync in range(60):
        piece = [gt] + [x] * 7 if sync in (2, 50) else [x] * 8
        ids[0, filled[0]:filled[0] + 8] = piece
        filled[0] += 8
        before = len(tok.decoded)
        assert not rows_.stopped(ids, filled, np.array([0]))[0]
        decoded_at += [sync] * (len(tok.decoded) - before)
    assert sorted(set(decoded_at)) == [2, 50] and len(decoded_at) == 2
    assert tok.decoded[-1] <= rows_.scanner.margin + 8  # the tail since sync 49, not the row's 400 tokens


class _Counting:
    """A tokenizer that records the length of every decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, []

    def decode(self, ids):
        self.decoded.append(len(ids))
        return self.tok.decode(ids)

    def encode(self, text, **kwargs):
        return self.tok.encode(text, **kwargs)


def test_stop_rows_decode_only_new_tails(tiny):
    """A row with no new token is not decoded again, a stopped row not at all, and a clean row's decode is its
    tail: what a sync costs no longer grows with the rows' lengths."""
    tok = _Counting(tiny[1])
    decoded = tok.decoded
    rows_ = StopRows(tok, ("</calc>",))
    ids, filled = np.full((2, 400), -1, np.int64), np.zeros(2, np.int64)
    x = tok.encode("x", add_special_tokens=False)[0]
    for sync in range(40):
        ids[0, filled[0]:filled[0] + 8] = x
        filled[0] += 8
        if sync == 3:
            end = tok.encode("</calc>", add_special_tokens=False)
            ids[1, :len(end)] = end
            filled[1] = len(end)
        rows_.stopped(ids, filled, np.array([0, 1]))
    assert max(decoded) <= rows_.scanner.margin + 8 + len(end)  # row 0's tails; row 1's whole row once
    assert len(decoded) == 40 + 2


# ----------------------------------------------------------------------------- kept blocks and refills

class _Turns:
    """turns hooks that accept every reported row's turn: (row -> tokens accepted)."""

    def __init__(self, accepted: dict):
        self.accepted = accepted

    def ended(self, row, ids, logprobs, entropies):
        return self.accepted[row]


def test_one_gather_per_sync_keeps_what_a_gather_per_row_kept():
    """TurnRows.report's blocks, one gather for all rows reported at a sync, equal a gather per row bit for bit."""
    rng = np.random.default_rng(0)
    layers, slots, Hkv, S, Dh = 3, 6, 2, 40, 4
    keys = mx.array(rng.normal(size=(layers, slots, Hkv, S, Dh)).astype(np.float32)).astype(mx.bfloat16)
    values = mx.array(rng.normal(size=(layers, slots, Hkv, S, Dh)).astype(np.float32)).astype(mx.bfloat16)
    start = np.array([3, 0, 10, 7, 1, 2])
    rows = np.array([4, 0, -1, 2, 5, 1])
    done = np.array([True, True, True, False, True, True])
    prompts = [5, 9, 4, 6, 8, 3]
    state = TurnRows(_Turns({0: 12, 1: 3, 4: 20, 5: None}), True, prompts, 1)
    written = (np.zeros((6, 30), np.int64), np.zeros((6, 30)), np.zeros((6, 30)), np.full(6, 30))
    state.report(written, rows, done, np.zeros(6, bool), keys, values, mx.array(start))
    want = per_row_blocks(keys, values, [(1, 0, prompts[0] + 11), (5, 1, prompts[1] + 2), (0, 4, prompts[4] + 19)],
                          start)
    assert sorted(state.blocks) == sorted(want) == [0, 1, 4]
    for r, (k, v) in want.items():
        kept = state.blocks[r]
        assert kept.length == k.shape[2]
        for got, expected in ((kept.keys, k), (kept.values, v)):
            block = got[kept.offset:kept.offset + kept.length].transpose(1, 2, 0, 3)
            assert block.dtype == expected.dtype
            np.testing.assert_array_equal(np.array(block.astype(mx.float32)), np.array(expected.astype(mx.float32)))


def test_fresh_contexts_prefill_on_a_bucketed_timeline_and_rows(tiny_model_dir):
    """CopyDecoder.prefill_contexts of 3 contexts (the longest 45) ending at slot 50: prefilled as 4 rows on 64
    slots (a power of two, a multiple of 64: few shapes for cuDNN), the 14 slots before the 50 dropped; bit for
    bit the prefill of the 3 rows on exactly 50 slots."""
    from mlx_grpo.rollout.copy_decoder import CopyDecoder

    model, _ = load_model(str(tiny_model_dir), "float32")
    spec, w = decoder.build(model, mx.float32)
    rng = np.random.default_rng(2)
    contexts = [[int(t) for t in rng.integers(3, 200, n)] for n in (30, 45, 7)]
    seen, original = [], decoder.prefill

    def spy(spec_, w_, tokens, padding):
        seen.append(tokens.shape)
        return original(spec_, w_, tokens, padding)

    decoder.prefill = spy
    try:
        keys, values, start, logits = CopyDecoder(spec, w, None, False, 0).prefill_contexts(contexts, 50)
    finally:
        decoder.prefill = original
    assert seen == [(4, 64)]
    tokens = mx.array([[0] * (50 - len(c)) + c for c in contexts], dtype=mx.int32)
    padding = mx.array([50 - len(c) for c in contexts], dtype=mx.int32)
    want_logits, want_k, want_v = original(spec, w, tokens, padding)
    assert keys.shape[:2] == (len(w["layers"]), 3) and keys.shape[3] == 50 and start.tolist() == padding.tolist()
    np.testing.assert_array_equal(np.array(logits), np.array(want_logits))
    for got, want in ((keys, want_k), (values, want_v)):
        for layer in range(len(want)):  # the real slots of each row (a pad's keys differ with its position)
            for r, c in enumerate(contexts):
                np.testing.assert_array_equal(np.array(got[layer, r, :, 50 - len(c):]),
                                              np.array(want[layer][r, :, 50 - len(c):]))


@pytest.mark.parametrize("shared", [True, False])
def test_resumed_prefill_of_gathered_blocks_equals_padded_rows(tiny_model_dir, shared):
    """prefill_resumed with its rows' blocks gathered into one timeline equals the per-row pad and stack it
    replaced, bit for bit: the pasts, and so the prefilled keys, values, starts and last logits; blocks from one
    sync's shared gather (and rows of two syncs) or each row's own."""
    model, _ = load_model(str(tiny_model_dir), "float32")
    spec, w = decoder.build(model, mx.float32)
    rng = np.random.default_rng(1)
    contexts = [[int(t) for t in rng.integers(3, 200, n)] for n in (14, 30, 9, 21, 17)]
    pasts = [5, 29, 1, 12, 16]
    layers = len(w["layers"])
    blocks = [(mx.array(rng.normal(size=(layers, spec.kv_heads, p, spec.head_dim)).astype(np.float32)),
               mx.array(rng.normal(size=(layers, spec.kv_heads, p, spec.head_dim)).astype(np.float32))) for p in pasts]
    if shared:  # rows 0-2 reported at one sync, 3-4 at another, each sync's blocks in one array
        kept = []
        for group in ((0, 1, 2), (3, 4)):
            k = mx.concatenate([blocks[i][0].transpose(2, 0, 1, 3) for i in group])
            v = mx.concatenate([blocks[i][1].transpose(2, 0, 1, 3) for i in group])
            offsets = np.concatenate([[0], np.cumsum([pasts[i] for i in group])[:-1]])
            kept += [Kept(k, v, int(o), pasts[i]) for i, o in zip(group, offsets)]
    else:
        kept = [Kept.of(k, v) for k, v in blocks]
    order = [3, 0, 4, 2, 1]  # admitted out of report order
    at = 48
    got = prefill_resumed(spec, w, [(contexts[i], kept[i]) for i in order], at, 0)
    admitted = [(contexts[i], blocks[i]) for i in order]
    width = bucket(max(len(c) for c, _ in admitted))  # bucketed; the slots before at - width are dropped after
    cut = max(0, width - at)
    want_k, want_v = padded_pasts(admitted, width)
    seen = []
    original = decoder.prefill_after

    def spy(spec_, w_, tokens, padding, past_k, past_v, start):
        seen.append((past_k, past_v))
        return original(spec_, w_, tokens, padding, past_k, past_v, start)

    decoder.prefill_after = spy
    try:
        again = prefill_resumed(spec, w, [(contexts[i], kept[i]) for i in order], at, 0)
    finally:
        decoder.prefill_after = original
    # the 5 rows run as 8 (row_bucket: few shapes for cuDNN's graphs), the first one repeated
    assert seen[0][0].shape[1] == 8
    for got_past, want_past in zip(seen[0], (want_k, want_v)):
        np.testing.assert_array_equal(np.array(got_past[:, :5]), np.array(want_past))
        np.testing.assert_array_equal(np.array(got_past[:, 5:]), np.array(mx.repeat(want_past[:, :1], 3, axis=1)))
    for a, b in zip(got[:4], again[:4]):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    # and the prefill on those pasts: what the per-row pads gave
    chunks = [c[k.shape[2]:] for c, (k, _) in admitted]
    C = min(bucket(max(len(c) for c in chunks)), width)
    tokens = mx.array([[0] * (C - len(c)) + c for c in chunks], dtype=mx.int32)
    start = mx.array([width - len(c) for c, _ in admitted], dtype=mx.int32)
    logits, keys, values = original(spec, w, tokens, mx.array([C - len(c) for c in chunks], dtype=mx.int32),
                                    want_k, want_v, start)
    np.testing.assert_array_equal(np.array(got[3]), np.array(logits))
    np.testing.assert_array_equal(np.array(got[0]), np.array(keys[..., cut:, :]))  # the slots ending at `at`
    np.testing.assert_array_equal(np.array(got[1]), np.array(values[..., cut:, :]))
    assert got[2].tolist() == (start + at - width).tolist() and got[4] == sum(len(c) for c in chunks)


@pytest.mark.parametrize("stop", ["\U0001f642" * 5, "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059"])
@pytest.mark.parametrize("per_sync", [1, 3, 5])
def test_stop_rows_find_stop_strings_of_multibyte_characters(tiny, stop, per_sync):
    """A stop string of 4-byte (or 3-byte) characters, which the byte-level tokenizer writes one token per byte,
    growing a few tokens per sync: found at the first sync whose whole text holds it (the scan margin counts
    bytes, not characters), by StopRows and by generate_rollout's StopScanner."""
    _, tok = tiny
    ids = tok.encode("hello " + stop + " and a tail after it", add_special_tokens=False)
    assert len(tok.encode(stop, add_special_tokens=False)) > 2 * len(stop) + 8  # more tokens than chars allow
    rows, scanner = StopRows(tok, (stop,)), StopScanner(tok, (stop,))
    arr, filled = np.full((1, len(ids)), -1, np.int64), np.zeros(1, np.int64)
    for n in list(range(per_sync, len(ids), per_sync)) + [len(ids)]:
        arr[0, :n], filled[0] = ids[:n], n
        want = stop in tok.decode(ids[:n])
        assert rows.stopped(arr, filled, np.array([0]))[0] == want, n
        assert (scanner.cut(0, ids[:n]) is not None) == want, n


def test_text_decoder_is_the_tokenizers_decode(tiny):
    """sampler.text_decoder: the backend's decode where transformers' decode adds nothing, the same text as
    tokenizer.decode for any ids (specials, partial UTF-8 bytes, empty); tokenizer.decode itself where a subclass
    or the space clean-up changes what decode writes."""
    from transformers import PreTrainedTokenizerFast

    from mlx_grpo.rollout.sampler import text_decoder

    tok = tiny[1]
    decode = text_decoder(tok)
    assert decode is not tok.decode and getattr(decode, "__self__", None) is None  # the fast path was taken
    rng = np.random.default_rng(0)
    V = len(tok.get_vocab())
    special = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    for n in [0, 1, 2, 5, 40] * 20:
        ids = [int(i) for i in rng.integers(0, V, size=n)] + special[:n % 3]
        assert decode(ids) == tok.decode(ids)

    class Spaced(PreTrainedTokenizerFast):
        def decode(self, ids, **kwargs):
            return "!" + super().decode(ids, **kwargs)
    class Inner(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return "?" + super()._decode(token_ids, **kwargs)
    hf = tok._tokenizer
    spaced, inner = Spaced(tokenizer_object=hf.backend_tokenizer), Inner(tokenizer_object=hf.backend_tokenizer)
    assert text_decoder(spaced)([1, 2]) == spaced.decode([1, 2])
    assert text_decoder(inner)([1, 2]) == inner.decode([1, 2]) == "?" + tok.decode([1, 2])
    hf_clean = PreTrainedTokenizerFast(tokenizer_object=hf.backend_tokenizer, clean_up_tokenization_spaces=True)
    assert text_decoder(hf_clean) == hf_clean.decode


def test_text_encoder_is_the_tokenizers_encode(tiny):
    """sampler.text_encoder: the backend's encode where transformers' encode adds nothing, the same ids as
    tokenizer.encode(text, add_special_tokens=False) for any text (special tokens written out, multi-byte
    characters, empty); encode itself where a subclass changes it or the backend has truncation set."""
    from transformers import PreTrainedTokenizerFast

    from mlx_grpo.rollout.sampler import text_encoder

    tok = tiny[1]
    encode = text_encoder(tok)
    assert getattr(encode, "__self__", None) is None and encode.__name__ == "encode"  # the fast path was taken
    texts = ["", " ", "Result: 42", "<|im_start|>tool\n3.5<|im_end|>\n", "é∑😀 x\n\n y", "<output>-7</output>"]
    rng = np.random.default_rng(0)
    alphabet = list("ab 0123456789+-*/=<>|_\nxé😀") + ["<|im_end|>", "<|im_start|>"]
    texts += ["".join(rng.choice(alphabet, size=n)) for n in [1, 3, 10, 40] * 10]
    for text in texts:
        assert encode(text) == list(tok.encode(text, add_special_tokens=False)), text

    hf = tok._tokenizer
    hf.split_special_tokens = True  # set after the encoder was made: it follows
    try:
        split = encode("<|im_end|>")
        assert split == list(tok.encode("<|im_end|>", add_special_tokens=False)) and len(split) > 1
    finally:
        hf.split_special_tokens = False
    whole = encode("<|im_end|>")
    assert whole == list(tok.encode("<|im_end|>", add_special_tokens=False)) and len(whole) == 1

    class Shouting(PreTrainedTokenizerFast):
        def encode(self, text, **kwargs):
            return super().encode(text.upper(), **kwargs)
    hf = tok._tokenizer
    shouting = Shouting(tokenizer_object=hf.backend_tokenizer)
    assert text_encoder(shouting)("ab") == shouting.encode("ab", add_special_tokens=False) != tok.encode("ab")
    truncating = PreTrainedTokenizerFast(tokenizer_object=hf.backend_tokenizer.__class__.from_str(
        hf.backend_tokenizer.to_str()))
    truncating.backend_tokenizer.enable_truncation(2)  # HF's encode turns it off first; so must the fast path
    assert text_encoder(truncating)("Result: 42") == list(tok.encode("Result: 42", add_special_tokens=False))
